"""The interop tests run the commands, which parse gin: each test leaves no bindings to the
next."""

from __future__ import annotations

import gin
import pytest


@pytest.fixture(autouse=True)
def _clear_gin_after_the_test():
    yield
    gin.clear_config()
