"""The interop tests run the commands, which parse gin: each test leaves no bindings to the
next."""

from __future__ import annotations

import pathlib

import gin
import pytest

# tiny Hugging Face models and transformers' outputs (scripts/make_hf_fixtures.py)
FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"


@pytest.fixture(autouse=True)
def _clear_gin_after_the_test():
    yield
    gin.clear_config()
