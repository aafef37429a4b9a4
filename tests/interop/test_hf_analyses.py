"""The routing analyses on an imported Switch model (the small random one of
tests/fixtures/hf, tokenizing with the byte vocabulary): `analyze positions`, `eval
--router`, `analyze languages`, `analyze trace`."""

from __future__ import annotations

import json
import pathlib

import pytest

from moe_jax import cli
from moe_jax.analysis import trace
from tests.interop.conftest import FIXTURES

DATA = ["--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.BATCH_SIZE=8"]
LAYERS = ["encoder/layers_1", "encoder/layers_3", "decoder/layers_1", "decoder/layers_3"]


@pytest.fixture(scope="module")
def switch_run(tmp_path_factory) -> pathlib.Path:
    run = tmp_path_factory.mktemp("switch") / "run"
    args = [f"--hf={FIXTURES / 'switch_step2'}", f"--model_dir={run}"]
    assert cli.main(["import", *args, "--gin.vocab.get_vocabulary.kind='byte'"]) == 0
    return run


def test_analyze_positions_on_an_imported_switch_model(switch_run, tmp_path):
    flags = ["--gin.positions_script.analyze.num_batches=1"]
    flags.append("--gin.positions_script.analyze.block_sizes=(4, 16)")
    args = ["analyze", "positions", f"--checkpoint={switch_run}", f"--out={tmp_path}", *DATA]
    assert cli.main([*args, *flags]) == 0
    result = json.loads((tmp_path / "positions.json").read_text())
    assert result["step"] == 0 and sorted(result["layers"]) == sorted(LAYERS)


@pytest.mark.slow  # two routers' evaluations: about 45 s on a 2-core CPU
def test_eval_router_on_an_imported_switch_model(switch_run, tmp_path):
    flags = [f"--checkpoint={switch_run}", f"--output_dir={tmp_path}", *DATA]
    flags += ["--gin.eval_script.evaluate.eval_steps=1", "--router=learned", "--router=random"]
    assert cli.main(["eval", *flags]) == 0
    results = json.loads((tmp_path / "comparison.json").read_text())
    assert {r["router"] for r in results.values()} == {"learned", "random"}
    for result in results.values():
        assert sorted(result["routing"]) == sorted(LAYERS)


@pytest.mark.slow  # 20 per-language data pipelines: about a minute of CPU
def test_analyze_languages_on_an_imported_switch_model(switch_run, tmp_path):
    flags = ["--gin.languages_script.analyze.max_examples_per_label=2"]
    flags.append("--gin.languages_script.analyze.batch_size=8")
    args = ["analyze", "languages", f"--checkpoint={switch_run}", f"--out={tmp_path}", *flags]
    assert cli.main([*args, "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}"]) == 0
    (result,) = json.loads((tmp_path / "languages.json").read_text())["checkpoints"]
    assert sorted(result["layers"]) == sorted(LAYERS)


def test_analyze_trace_on_an_imported_switch_model(switch_run):
    flags = ["--gin.trace_script.collect.max_examples=8", "--gin.trace_script.collect.batch_size=8"]
    flags.append("--gin.trace_script.collect.use_labels=False")
    args = ["analyze", "trace", f"--checkpoint={switch_run}", *flags]
    assert cli.main([*args, DATA[0]]) == 0
    (path,) = (switch_run / "analysis" / "trace").glob("trace_*_step0.parquet")  # the default
    result = trace.read(str(path))
    assert sorted(result.layers) == sorted(LAYERS)
    for layer in result.layers.values():  # Switch: top-1
        assert layer.k == 1 and (layer.experts < layer.num_experts).all()
        assert layer.example.max() == 7 and (layer.probs > 0).all()
