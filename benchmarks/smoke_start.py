"""Time to the smoke run's first step, with a cold and a warm compilation cache.

    python benchmarks/smoke_start.py [--steps 2] [--repo [LABEL=]DIR ...] [--rounds N]

Runs ``moe-jax smoke --gin.TRAIN_STEPS=N`` twice, each in a fresh process on a terminal
(a pseudo-terminal: what ``make smoke`` in a shell shows), both pointed at
one new, empty JAX compilation cache (``JAX_COMPILATION_CACHE_DIR``): the first run
compiles everything (cold), the second loads what the first compiled (warm), as a second
``make smoke`` on the same machine does. Prints the seconds from the process' start to its
first line of output, to its first finished training step (the line ``step 1 done``, or
for a tree without it the progress bar's first update) and to its end, and the CPU seconds
the process had used at its first step (``/proc``; on a loaded machine the wall times
stretch, the CPU seconds much less). ``--repo``: the checkout to time (default: this one),
e.g. an older commit unpacked with ``git archive``; given several times, the checkouts
take turns, ``--rounds`` times (each with its own new cache), so that all of them see the
same load. Each row names the 1-minute load average at its start. After the table, the
stage lines (``[moe-jax] ...``) of each checkout's last warm run, with the second each
was printed at.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pathlib
import pty
import re
import struct
import subprocess
import sys
import tempfile
import termios
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
FIRST_STEP = re.compile(rb"step 1 done|\| 1/\d+ \[")
STAGE = re.compile(rb"\[moe-jax\] (?:\S+Z )?([^\r\n]+)")


def _read(fd: int) -> bytes:
    """The next output of the terminal ``fd``; b"" once the child has closed it."""
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: no process holds the terminal any more
        return b""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (Linux ``/proc``)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_smoke(repo: pathlib.Path, steps: int, cache: str) -> dict[str, Any]:
    """Seconds to the first output, the first step and the end of one smoke run, the CPU
    seconds used by the first step, and (``stages``) each stage line up to the first step
    with the second it was printed at."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, PYTHONPATH=str(repo))
    terminal, child_end = pty.openpty()
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 120 columns
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "moe_jax.cli", "smoke", f"--gin.TRAIN_STEPS={steps}"],
        cwd=repo,
        env=env,
        stdout=child_end,
        stderr=child_end,
    )
    os.close(child_end)
    marks: dict[str, Any] = {"stages": []}
    seen = b""
    while chunk := _read(terminal):
        now = time.perf_counter() - start
        seen += chunk
        marks.setdefault("first output", now)
        if "first step" in marks:
            continue
        done = FIRST_STEP.search(seen)
        stages = STAGE.findall(seen if done else seen[: seen.rfind(b"\n") + 1])  # whole lines
        marks["stages"] += [(line.decode(), now) for line in stages[len(marks["stages"]) :]]
        if done:
            if not marks["stages"] or "step 1" not in marks["stages"][-1][0]:
                marks["stages"].append(("step 1 done (the progress bar's line)", now))
            marks["first step"] = now
            marks["first step cpu"] = cpu_seconds(child.pid)
    os.close(terminal)
    if child.wait() != 0:
        raise SystemExit(f"smoke failed:\n{seen.decode(errors='replace')[-3000:]}")
    marks["end"] = time.perf_counter() - start
    return marks


def _checkout(text: str) -> tuple[str, pathlib.Path]:
    """``LABEL=DIR`` or ``DIR`` (labelled by its name) of ``--repo``."""
    label, _, path = text.rpartition("=")
    return label or pathlib.Path(path).name, pathlib.Path(path).resolve()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="TRAIN_STEPS of the smoke run")
    parser.add_argument(
        "--repo", action="append", type=_checkout, help="[LABEL=]DIR: a checkout to time"
    )
    parser.add_argument("--rounds", type=int, default=1, help="turns of every checkout")
    args = parser.parse_args(argv)
    checkouts = args.repo or [("this tree", REPO)]
    rows, stages = [], {}
    for _ in range(args.rounds):
        for label, repo in checkouts:
            with tempfile.TemporaryDirectory(prefix="smoke_start_cache_") as cache:
                for cache_state in ("cold", "warm"):
                    load = os.getloadavg()[0]
                    marks = time_smoke(repo, args.steps, cache)
                    rows.append(
                        f"| {label} | {load:.1f} | {cache_state} | "
                        f"{marks['first output']:.1f} | "
                        f"{marks.get('first step', float('nan')):.1f} | "
                        f"{marks.get('first step cpu', float('nan')):.1f} | {marks['end']:.1f} |"
                    )
                stages[label] = marks["stages"]
    print(f"`moe-jax smoke --gin.TRAIN_STEPS={args.steps}`, seconds from the process start")
    print(
        "| code | load average | compilation cache | first output (s) | first step done (s) "
        "| CPU used by then (s) | whole command (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    for label, lines in stages.items():
        print(f"\nstages of the last warm run of {label}:")
        print("| stage line | printed at (s) |\n| --- | --- |")
        print("\n".join(f"| {line} | {at:.1f} |" for line, at in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
