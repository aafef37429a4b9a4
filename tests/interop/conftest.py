"""The interop tests run the commands, which parse gin: each test leaves no bindings to the
next."""

from __future__ import annotations

import pathlib

import gin
import pytest

from moe_jax import cli

# tiny Hugging Face models and transformers' outputs (scripts/make_hf_fixtures.py)
FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"


@pytest.fixture(autouse=True)
def _clear_gin_after_the_test():
    yield
    gin.clear_config()


def import_fixtures(tmp_path_factory, cases: tuple[str, ...]) -> dict[str, pathlib.Path]:
    """Each named fixture imported (`moe-jax import --hf`) into a run directory of its own."""
    runs = {}
    for case in cases:
        runs[case] = tmp_path_factory.mktemp(case) / "run"
        assert cli.main(["import", f"--hf={FIXTURES / case}", f"--model_dir={runs[case]}"]) == 0
    return runs
