"""Weights & Biases beside TensorBoard, in ``WANDB_MODE=offline`` (no server): what the
metrics writer sends, the run's config, the run id kept for a resumed run, and no ``wandb``
import without a project. The offline run's ``.wandb`` file is read back record by record."""

from __future__ import annotations

import pathlib
import struct
import subprocess
import sys
import time

import gin
import numpy as np
import pytest

from moe_jax.runtime import wandb_logger
from moe_jax.runtime.metrics import MetricsWriter, read_metrics
from moe_jax.runtime.run_dir import RunDir

CONFIG = """\
# a comment
train_script.train.total_steps = 3
MoeConfig.capacity = @CapacityConfig()
TASK_FEATURE_LENGTHS = {'inputs': 32,
                        'targets': 8}
"""


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))


def wandb_records(model_dir: pathlib.Path, runs: int = 1, timeout: float = 60.0) -> list:
    """Every record of the offline runs under ``model_dir/wandb``, in run order, once
    ``runs`` run records and as many finished runs are on disk: W&B's service process
    writes the log after ``finish()`` returns, later on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        records = _read_records(model_dir)
        kinds = [r.WhichOneof("record_type") for r in records]
        if (kinds.count("run") >= runs and kinds.count("exit") >= runs) or (
            time.monotonic() > deadline
        ):
            return records
        time.sleep(0.2)


def _read_records(model_dir: pathlib.Path) -> list:
    """The records of W&B's leveldb-style logs under ``model_dir/wandb``: a 7-byte file
    header, 32 KiB blocks of chunks with 7-byte headers."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(model_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, pending = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            pending += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or the last chunk of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append(record)
                pending = b""
    return records


def history(records: list) -> dict[int, dict[str, str]]:
    """``{step: {key: value json}}`` of the logged rows."""
    rows: dict[int, dict[str, str]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            rows.setdefault(int(items["_step"]), {}).update(items)
    return rows


def test_gin_bindings_one_key_per_binding():
    assert wandb_logger.gin_bindings(CONFIG) == {
        "train_script.train.total_steps": "3",
        "MoeConfig.capacity": "@CapacityConfig()",
        "TASK_FEATURE_LENGTHS": "{'inputs': 32, 'targets': 8}",
    }


def test_the_writer_sends_every_metric_and_a_resumed_run_continues_its_wandb_run(tmp_path):
    run_dir = RunDir(str(tmp_path))
    (tmp_path / "config.gin").write_text(CONFIG)
    settings = wandb_logger.WandbSettings(project="moe", name="tiny", tags=("cpu", "test"))
    logger = wandb_logger.start(run_dir, settings)
    assert logger is not None
    writer = MetricsWriter(run_dir, 1, logger)
    load = np.array([0.5, 0.25, 0.75, 0.5])
    writer.write("train", 3, {"loss": 2.5, "moe": {"encoder/layers_1": {"expert_load": load}}})
    writer.write("eval", 3, {"accuracy": 0.125})
    writer.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert run_id == logger.run_id
    records = wandb_records(tmp_path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "moe", "tiny")
    assert list(run.tags) == ["cpu", "test"]
    config = {item.key: item.value_json for item in run.config.update}
    assert "total_steps = 3" in config["gin_config"]
    assert config["train_script.train.total_steps"] == '"3"'
    rows = history(records)
    assert rows[3]["train/loss"] == "2.5" and rows[3]["eval/accuracy"] == "0.125"
    # the routing telemetry TensorBoard gets, and the load as a histogram
    key = "train/moe/encoder/layers_1"
    assert float(rows[3][f"{key}/max_violation"]) == pytest.approx(0.5)
    assert rows[3][f"{key}/expert_load/_type"] == '"histogram"'
    tensorboard = read_metrics(run_dir, "train")
    assert tensorboard[0]["moe/encoder/layers_1/max_violation"] == pytest.approx(0.5)

    # a second start (a resumed run) reuses the id and logs on
    again = wandb_logger.start(run_dir, settings)
    assert again is not None and again.run_id == run_id
    writer = MetricsWriter(run_dir, 1, again)
    writer.write("train", 4, {"loss": 2.0})
    writer.close()
    records = wandb_records(tmp_path, runs=2)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert [r.run_id for r in runs] == [run_id, run_id]
    assert float(history(records)[4]["train/loss"]) == 2.0


def test_no_project_no_wandb_run_and_no_import(tmp_path):
    gin.clear_config()
    assert wandb_logger.start(RunDir(str(tmp_path))) is None
    assert not (tmp_path / "wandb_run_id").exists()
    code = (
        "import sys\n"
        "from moe_jax.commands import train\n"
        "from moe_jax.runtime import wandb_logger\n"
        "from moe_jax.runtime.run_dir import RunDir\n"
        f"assert wandb_logger.start(RunDir({str(tmp_path)!r})) is None\n"
        "print('wandb' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def _train(model_dir: pathlib.Path, steps: int) -> None:
    from moe_jax.commands import train
    from moe_jax.runtime import builders, gin_flags, gin_utils
    from tests.analysis.conftest import TINY

    flags = [
        *TINY,
        f"--gin.MODEL_DIR={model_dir}",
        f"--gin.TRAIN_STEPS={steps}",
        "--gin.WANDB_PROJECT='moe-jax-test'",
        "--gin.WANDB_TAGS=('tiny',)",
    ]
    gin_utils.parse_gin(gin_flags.parse_flags(builders.build_parser("test", "test"), flags))
    try:
        train.train()
    finally:
        gin.clear_config()


@pytest.mark.slow
def test_a_training_run_and_its_resumption_log_to_one_wandb_run(tmp_path):
    _train(tmp_path, 1)
    run_id = (tmp_path / "wandb_run_id").read_text()
    _train(tmp_path, 2)  # resumes from step 1
    records = wandb_records(tmp_path, runs=2)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert [(r.run_id, r.project, list(r.tags)) for r in runs] == [
        (run_id, "moe-jax-test", ["tiny"])
    ] * 2
    config = {item.key: item.value_json for item in runs[0].config.update}
    assert str(tmp_path) in config["MODEL_DIR"]  # MODEL_DIR/config.gin, one key per binding
    assert config["train.total_steps"] == '"%TRAIN_STEPS"' and "MODEL_DIR" in config["gin_config"]
    rows = history(records)
    tensorboard = read_metrics(RunDir(str(tmp_path)), "train")
    assert [r["step"] for r in tensorboard] == [1, 2] and sorted(rows) == [1, 2]
    for record in tensorboard:  # every TensorBoard scalar, the same value
        row = rows[record["step"]]
        for name, value in record.items():
            if name not in ("step", "split") and not isinstance(value, list):
                assert float(row[f"train/{name}"]) == pytest.approx(value, rel=1e-6), name
