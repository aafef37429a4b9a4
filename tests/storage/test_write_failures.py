"""Failed writes made to happen for real: a file-size limit (RLIMIT_FSIZE) on a small
subprocess that writes through :mod:`moe_jax.storage`; a torn ``metrics.jsonl`` line
dropped on resume; Ctrl-C and SIGTERM turned into one line and 130 / 143 by the CLI."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moe_jax import cli, errors
from moe_jax.runtime.metrics import drop_records_after
from moe_jax.runtime.run_dir import RunDir

WRITER = textwrap.dedent("""
    import json, resource, sys
    from moe_jax import errors, storage

    resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))  # a file-size limit of 100 bytes
    folder = sys.argv[1]
    appender = storage.AppendFile(f"{folder}/metrics.jsonl")
    appender.append(b"x" * 59 + b"\\n")                   # 60 bytes: under the limit
    outcome = {}
    for name, write in (("append", lambda: appender.append(b"y" * 59 + b"\\n")),
                        ("whole", lambda: storage.write_bytes(f"{folder}/config.gin", b"z" * 200))):
        try:
            write()
        except errors.WriteFailedError as err:
            outcome[name] = [str(err), err.exit_code]
    appender.close()
    print(json.dumps(outcome))
""")


def test_writes_over_a_size_limit_fail_whole_and_name_the_file(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcome = json.loads(proc.stdout)
    assert outcome == {
        "append": [
            f"cannot write {tmp_path}/metrics.jsonl: File too large",
            errors.EXIT_WRITE_FAILED,
        ],
        "whole": [f"cannot write {tmp_path}/config.gin: File too large", errors.EXIT_WRITE_FAILED],
    }
    # the append that crossed the limit was cut back to where it began: lines stay whole
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"x" * 59 + b"\n"
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no temporary file left


def test_a_torn_last_metrics_line_is_dropped_on_resume_with_a_warning(tmp_path, capsys):
    lines = [json.dumps({"step": step, "split": "train", "loss": 1.0 / step}) for step in (1, 2, 3)]
    pathlib.Path(RunDir(tmp_path).metrics_file).write_text("\n".join(lines) + "\n" + lines[0][:17])
    drop_records_after(RunDir(tmp_path), 2)
    assert pathlib.Path(RunDir(tmp_path).metrics_file).read_text() == "\n".join(lines[:2]) + "\n"
    assert capsys.readouterr().err == (
        f"[moe-jax] warning: {RunDir(tmp_path).metrics_file}, line 4: not a whole JSON record "
        "(a write cut short); dropped\n"
    )


def _sigterm_self(argv: list[str]) -> int:
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not stop the command")


class _Finalizer:
    def __del__(self) -> None:
        raise errors.Interrupted(signal.SIGTERM)  # as a signal landing in a GC callback


def _sigterm_in_a_finalizer(argv: list[str]) -> int:
    _Finalizer()  # Python can only report its finalizer's exception ("Exception ignored")
    for _ in range(1000):  # the signal delivered again stops the command here
        time.sleep(0.001)
    raise AssertionError("the interrupt was lost")


def _ctrl_c(argv: list[str]) -> int:
    raise KeyboardInterrupt


def _train_like(argv: list[str]) -> int:
    raise errors.Interrupted(
        signal.SIGTERM, "at step 7: saved D/checkpoints/7; the same command resumes from it"
    )


@pytest.mark.parametrize(
    "command, code, line",
    [
        (
            _ctrl_c,
            errors.EXIT_INTERRUPTED,
            f"moe-jax x: stopped by Ctrl-C (SIGINT): {cli.INTERRUPTED_DETAIL}",
        ),
        (
            _sigterm_self,
            errors.EXIT_PREEMPTED,
            f"moe-jax x: stopped by SIGTERM: {cli.INTERRUPTED_DETAIL}",
        ),
        (
            _sigterm_in_a_finalizer,
            errors.EXIT_PREEMPTED,
            f"moe-jax x: stopped by SIGTERM: {cli.INTERRUPTED_DETAIL}",
        ),
        (
            _train_like,
            errors.EXIT_PREEMPTED,
            "moe-jax x: stopped by SIGTERM: at step 7: saved D/checkpoints/7; the same command "
            "resumes from it",
        ),
    ],
)
def test_interrupts_end_with_one_line_and_their_exit_code(command, code, line, capsys, monkeypatch):
    monkeypatch.delenv("MOE_JAX_TRACEBACK", raising=False)
    with cli.sigterm_interrupts():
        assert cli.run_command("x", command, []) == code
    assert capsys.readouterr().err == line + "\n"
    monkeypatch.setenv("MOE_JAX_TRACEBACK", "1")  # the traceback on request
    with pytest.raises(KeyboardInterrupt), cli.sigterm_interrupts():
        cli.run_command("x", command, [])
