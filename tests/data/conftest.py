"""Shared helpers of the data tests: gin state is cleared around every test."""

from __future__ import annotations

import gin
import pytest


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()
