"""What `moe-jax train` (and `moe-jax smoke`) does before its first step, and what it leaves
for later: a new run's data pipeline is built on a background thread while the step
compiles (same losses, same config, its errors raised on the main thread as they were);
the CPU's matmul rate is measured at the first logged MFU, not before the first step;
a float32 model's loss is not traced to look for compute copies it cannot have.
Speed is measured in benchmarks/smoke_start.py, not here."""

from __future__ import annotations

import math
import pathlib
import threading

import gin
import jax
import pytest

from moe_jax import cli, errors, hardware
from moe_jax.commands import train
from moe_jax.data import pipeline
from moe_jax.runtime import builders
from moe_jax.runtime.background import Background
from moe_jax.runtime.throughput import ThroughputMeter
from tests.train.test_compute_copies import SHAPES, _setup
from tests.train.test_train import TINY, parse
from tests.train.test_train import run as train_run


def test_background_returns_the_value_on_the_waiting_thread():
    names = []

    def work() -> int:
        names.append(threading.current_thread().name)
        return 42

    started = Background(work, "answer")
    assert started.result() == 42 and started.result() == 42
    assert names == ["answer"] and started.done and started.taken


def test_background_error_is_raised_as_it_was_naming_the_thread():
    """The exception of the work, not a wrapper: the command's one-line error reads as it
    did without the thread; its traceback notes the thread."""

    def work() -> None:
        raise ValueError("unknown task or mixture MIXTURE_OR_TASK_NAME='nope'")

    started = Background(work, "training data pipeline")
    for _ in range(2):  # every wait raises it, noted once
        with pytest.raises(ValueError) as raised:
            started.result()
        assert raised.value.__notes__ == [
            "(raised on the background thread 'training data pipeline')"
        ]
    assert cli.error_message(raised.value) == (
        "unknown task or mixture MIXTURE_OR_TASK_NAME='nope'"
    )
    assert any(frame.name == "work" for frame in raised.traceback)  # where it was raised


def test_background_failed_import_reaches_the_main_thread():
    def work() -> None:
        import moe_jax.no_such_module  # noqa: F401

    with pytest.raises(ModuleNotFoundError, match=r"moe_jax\.no_such_module"):
        Background(work, "import").result()


def test_discard_closes_the_value_and_drops_an_error():
    closed = []
    Background(lambda: "stream", "ok").discard(closed.append)
    assert closed == ["stream"]
    Background(lambda: 1 / 0, "fails").discard(closed.append)  # nothing raised, nothing closed
    assert closed == ["stream"]


def test_throughput_meter_asks_for_the_peak_at_its_first_rates_only():
    asked = []

    def peak() -> float:
        asked.append(1)
        return 1e9

    meter = ThroughputMeter(flops_per_step=1e6, tokens_per_step=10, peak_flops_total=peak)
    assert asked == []  # nothing measured before the first step
    meter.tick()
    first = meter.rates()
    meter.tick()
    second = meter.rates()
    assert asked == [1]
    for rates in (first, second):
        assert rates["mfu"] == pytest.approx(rates["steps_per_sec"] * 1e6 / 1e9)
    assert ThroughputMeter(1e6, 10, 2e9).peak_flops_total == 2e9


def test_cpu_facts_for_the_fit_measure_no_matmul(monkeypatch):
    def measured(*args, **kwargs) -> float:
        raise AssertionError("measured the matmul rate")

    monkeypatch.setattr(hardware, "measured_matmul_flops", measured)
    facts = hardware.device_facts(jax.devices(), measure=False)
    assert facts.hbm_bytes > 0 and math.isnan(facts.peak_flops)


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--gin_file=routers/deepseek_v3.gin",),
        ("--gin_file=routers/hash.gin",),
        ("--gin_file=models/t5_dense.gin",),
    ],
    ids=["top2", "deepseek_v3", "hash", "dense"],
)
def test_float32_activations_skip_the_trace_that_would_find_no_copy(flags, monkeypatch):
    """With float32 activations no parameter is read cast to a narrower dtype:
    ``builders.compute_dtypes`` answers ``{}`` without tracing the loss (one trace of the
    network fewer before the first step), and the trace it skips finds none either."""
    try:
        _, model, ctx = _setup(*flags)
        assert builders.traced_compute_dtypes(model, SHAPES, ctx) == {}
        traced = []
        monkeypatch.setattr(model, "train_loss_fn", lambda *args: traced.append(args))
        assert builders.compute_dtypes(model, SHAPES, ctx) == {}
        assert traced == []
    finally:
        gin.clear_config()


def _pipeline_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "training data pipeline"}


def _config(model_dir: pathlib.Path) -> str:
    """The run's recorded gin config, its ``MODEL_DIR`` named so."""
    return (model_dir / "config.gin").read_text().replace(str(model_dir), "MODEL_DIR")


def test_stream_built_meanwhile_trains_as_the_stream_built_after_the_state(tmp_path, monkeypatch):
    """A new run's data pipeline built on a background thread while the step compiles
    gives the run of the pipeline built after the state: the same losses bit for bit, the
    same recorded config; the thread is gone after the run."""
    dirs = [tmp_path / "1" / "run", tmp_path / "2" / "run"]  # paths of the same length
    meanwhile = train_run(dirs[0], 2)
    with monkeypatch.context() as after:
        after.setattr(train, "_STREAM_MEANWHILE", False)
        built_after = train_run(dirs[1], 2)
    assert meanwhile["losses"] == built_after["losses"] and len(meanwhile["losses"]) == 2
    assert _config(dirs[0]) == _config(dirs[1])
    assert not _pipeline_threads()


def test_stream_error_is_raised_on_the_main_thread_as_it_was(tmp_path, capsys):
    """An unknown task fails the background build: the command says so in the one line it
    said before, and the run directory it created is gone."""
    model_dir = tmp_path / "new_run"
    flags = [f"--gin.MODEL_DIR={model_dir}", "--gin.MIXTURE_OR_TASK_NAME='no_such_task'"]
    assert cli.main(["train", *TINY, *flags]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "moe-jax train: error: unknown task or mixture MIXTURE_OR_TASK_NAME='no_such_task'"
    )
    assert not model_dir.exists()
    parse(*flags)
    with pytest.raises(ValueError, match="no_such_task") as raised:
        train.train()
    assert raised.value.__notes__ == ["(raised on the background thread 'training data pipeline')"]
    assert not _pipeline_threads()


def test_setup_refused_before_the_stream_is_taken_closes_it(tmp_path, monkeypatch):
    """A start refused while the stream is being built (here: a binding nothing reads)
    waits for the build and closes the stream: no thread of it is left running."""
    closed = []
    close = pipeline.TrainIterator.close
    monkeypatch.setattr(pipeline.TrainIterator, "close", lambda it: closed.append(it) or close(it))
    parse(f"--gin.MODEL_DIR={tmp_path}", "--gin.NoisyTopKRouterConfig.init_stddev=0.5")
    with pytest.raises(errors.ConfigError, match="no part of the model reads"):
        train.train(command_line_bindings=["NoisyTopKRouterConfig.init_stddev=0.5"])
    assert len(closed) == 1 and not closed[0]._thread.is_alive()
    assert not _pipeline_threads()
