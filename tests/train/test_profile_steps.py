"""``train.profile_steps``: a device trace of exactly the chosen steps in MODEL_DIR/profile,
and a bad value refused by name before anything runs."""

from __future__ import annotations

import collections
import gzip
import json
import pathlib

import pytest

from moe_jax import errors
from moe_jax.runtime import profiling
from tests.train.test_train import run


def _traced_iterations(model_dir: pathlib.Path) -> collections.Counter:
    """How often the loop's iteration and the step's executable appear in the trace."""
    (trace,) = (model_dir / "profile" / "plugins" / "profile").glob("*/*.trace.json.gz")
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    names = collections.Counter(e.get("name", "") for e in events if e.get("ph") == "X")
    return collections.Counter(
        {
            "iterations": sum(n for k, n in names.items() if "training_loop_iteration" in k),
            "steps": names["PjitFunction(jit(train_step))"],
        }
    )


def test_the_trace_holds_the_chosen_steps_only(tmp_path, capsys):
    result = run(tmp_path / "run", 4, "--gin.train_script.train.profile_steps=(2, 2)")
    assert result["step"] == 4
    traced = _traced_iterations(tmp_path / "run")
    assert traced["iterations"] == 2  # steps 2 and 3 of 4
    assert traced["steps"] >= 2
    assert "traced steps 2-3 into" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["(0, 2)", "(3,)", "'5'", "(2, -1)"])
def test_a_bad_window_is_refused_by_name(tmp_path, value):
    with pytest.raises(errors.ConfigError, match=r"train.profile_steps=.*\(first step, count\)"):
        run(tmp_path / "run", 2, f"--gin.train_script.train.profile_steps={value}")
    assert not (tmp_path / "run").exists()


def _kernel(name: str, start_us: float, dur_us: float, stream: int = 1, pid: int = 7) -> dict:
    return {"ph": "X", "pid": pid, "tid": stream, "name": name, "ts": start_us, "dur": dur_us}


def test_device_timeline_counts_overlapping_streams_once_and_names_the_gaps():
    """A planted timeline: two streams overlap (a and b), a 30 us gap after b, a 5 us gap
    after c; host events (another process) and the process metadata are not kernels."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        _kernel("a", 0, 40),
        _kernel("b", 20, 40, stream=2),  # a and b overlap: busy 0-60
        _kernel("c", 90, 10),  # idle 60-90
        _kernel("d", 105, 15),  # idle 100-105
        _kernel("host work", 60, 30, pid=1),
    ]
    timeline = profiling.device_timeline(events)
    assert timeline.span_ms == pytest.approx(0.120)
    assert timeline.busy_ms == pytest.approx(0.085)
    assert timeline.kernel_ms == pytest.approx(0.105)
    assert timeline.busy_fraction == pytest.approx(85 / 120)
    assert timeline.gaps == (
        profiling.Gap(pytest.approx(0.030), "b", "c"),
        profiling.Gap(pytest.approx(0.005), "c", "d"),
    )
    assert "longest idle gap 0.03 ms, after b, before c" in timeline.describe()
    assert profiling.device_timeline(events[1:2] + events[-1:]).span_ms == 0.0
