"""`moe-jax eval` of a run's checkpoint reproduces the run's own evaluation: the run records
its eval settings (batches, batch size, feature lengths, task, split) in
MODEL_DIR/eval_settings.json, eval uses them and says so, and the flags override them.
Its output: no orbax read-only warning, MoE layers in depth order."""

from __future__ import annotations

import json
import pathlib

import gin
import pytest

from moe_jax import cli
from moe_jax.commands import evaluate
from moe_jax.runtime.run_dir import RunDir

# The in-training evaluation reads 3 batches of 8 rows; runs/eval.gin's default (8 batches
# of smoke_cpu.gin's EVAL_STEPS, BATCH_SIZE rows) would give other numbers.
TRAIN = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.TRAIN_STEPS=2",
    "--gin.train_script.train.eval_period=2",
    "--gin.train_script.train.eval_steps=3",
]


@pytest.fixture(autouse=True)
def _fresh_gin():
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
    model_dir = tmp_path_factory.mktemp("eval_settings") / "run"
    rc = cli.main(["train", *TRAIN, f"--gin.MODEL_DIR={model_dir}"])
    gin.clear_config()
    assert rc == 0
    return model_dir


def _run_eval(model_dir: pathlib.Path) -> dict:
    """The run's own eval record of its last step (metrics.jsonl)."""
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "eval"][-1]


def _eval(capsys, tmp_path, *flags: str) -> tuple[dict, str]:
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    assert cli.main(["eval", *flags, f"--output_dir={out}"]) == 0
    result = next(iter(json.loads((out / "comparison.json").read_text()).values()))
    return result, capsys.readouterr().err


def test_eval_of_a_run_gives_the_numbers_the_run_printed(run, tmp_path, capsys):
    recorded = json.loads((pathlib.Path(RunDir(run).eval_settings_file)).read_text())
    assert recorded["eval_steps"] == 3 and recorded["dataset"]["task_feature_lengths"] == {
        "inputs": 32,
        "targets": 8,
    }
    assert recorded["dataset"]["split"] == "validation"
    own = _run_eval(run)
    result, err = _eval(capsys, tmp_path, f"--checkpoint={run}")
    assert f"eval settings: the run's, from {pathlib.Path(RunDir(run).eval_settings_file)}" in err
    assert (
        "evaluated 3 batches of 8 x {'inputs': 32, 'targets': 8} from the validation split of "
        "task mc4_span_corruption over the embedded UDHR corpus (20 languages)" in err
    )
    assert result["step"] == own["step"] == 2
    for metric in ("cross_entropy", "accuracy", "loss"):
        assert result["metrics"][metric] == pytest.approx(own[metric], rel=1e-6), metric

    other, err = _eval(capsys, tmp_path, f"--checkpoint={run}", "--eval_steps=1")
    assert "--eval_steps=1" in err and "evaluated 1 batch of 8" in err
    assert other["metrics"]["cross_entropy"] != pytest.approx(own["cross_entropy"], rel=1e-6)


def test_reading_a_checkpoint_prints_no_orbax_warning(run, capfd):
    """Readers open checkpoints read-only; orbax's warning about it (via absl logging, to
    stderr) is dropped."""
    import logging

    from moe_jax.runtime import checkpoints

    handler = logging.StreamHandler()  # what absl's handler does outside pytest
    logging.getLogger("absl").addHandler(handler)
    try:
        ckpt = checkpoints.Checkpointer(RunDir(run), read_only=True)
        assert ckpt.latest_step() == 2
        ckpt.close()
    finally:
        logging.getLogger("absl").removeHandler(handler)
    assert "read only" not in capfd.readouterr().err


def test_layer_tables_list_layers_by_depth():
    """encoder before decoder, layers_3 before layers_11 (not string order)."""
    metrics = {
        f"moe/{stack}/layers_{i}/dropped_fraction": 0.1 * i
        for stack in ("decoder", "encoder")
        for i in (11, 3, 7)
    }
    routing = evaluate.routing_by_layer(metrics)
    expected = [f"{stack}/layers_{i}" for stack in ("encoder", "decoder") for i in (3, 7, 11)]
    assert list(routing) == expected
    table = evaluate.comparison_table(
        {"run": {"step": 1, "metrics": {}, "routing": routing, "router_drift": {}}}
    )
    rows = [line.split(" dropped")[0] for line in table.splitlines() if " dropped" in line]
    assert rows == expected


def test_gin_settings_on_request_and_when_the_run_recorded_none(run, tmp_path, capsys):
    """--eval_settings=gin: runs/eval.gin's eval steps (smoke_cpu.gin: EVAL_STEPS = 8) and the
    run's BATCH_SIZE; a run without a record falls back to them, saying so."""
    _, err = _eval(
        capsys,
        tmp_path,
        f"--checkpoint={run}",
        "--eval_settings=gin",
        "--gin.eval_script.evaluate.eval_steps=2",
    )
    assert "eval settings: runs/eval.gin's" in err and "evaluated 2 batches of 8 x" in err
    (pathlib.Path(RunDir(run).eval_settings_file)).rename(run / "kept.json")
    try:
        _, err = _eval(
            capsys, tmp_path, f"--checkpoint={run}", "--gin.eval_script.evaluate.eval_steps=2"
        )
    finally:
        (run / "kept.json").rename(pathlib.Path(RunDir(run).eval_settings_file))
    assert f"({run} recorded none)" in err
