"""Shared helpers of the data tests: gin state is cleared around every test."""

from __future__ import annotations

import gin
import pytest

# registers the gin names (``make_source``, ...) that the tests bind with
# ``gin.bind_parameter``, whichever test of a worker runs first
from moe_jax.runtime import configured  # noqa: F401


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()
