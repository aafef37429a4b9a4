"""Time to the smoke run's first step, with a cold and a warm compilation cache.

    python benchmarks/smoke_start.py [--steps 2] [--repo DIR]

Runs ``moe-jax smoke --gin.TRAIN_STEPS=N`` twice, each in a fresh process on a terminal
(a pseudo-terminal: what ``make smoke`` in a shell shows), both pointed at
one new, empty JAX compilation cache (``JAX_COMPILATION_CACHE_DIR``): the first run
compiles everything (cold), the second loads what the first compiled (warm), as a second
``make smoke`` on the same machine does. Prints the seconds from the process' start to its
first line of output, to its first finished training step (the line ``step 1 done``, or
for a tree without it the progress bar's first update) and to its end, and the CPU seconds
the process had used at its first step (``/proc``; on a loaded machine the wall times
stretch, the CPU seconds much less). ``--repo``: the checkout to time (default: this one),
e.g. an older commit unpacked with ``git archive``.
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

REPO = pathlib.Path(__file__).resolve().parents[1]
FIRST_STEP = re.compile(rb"step 1 done|\| 1/\d+ \[")


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


def time_smoke(repo: pathlib.Path, steps: int, cache: str) -> dict[str, float]:
    """Seconds to the first output, the first step and the end of one smoke run, and the
    CPU seconds used by the first step."""
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
    marks: dict[str, float] = {}
    seen = b""
    while chunk := _read(terminal):
        now = time.perf_counter() - start
        seen += chunk
        marks.setdefault("first output", now)
        if "first step" not in marks and FIRST_STEP.search(seen):
            marks["first step"] = now
            marks["first step cpu"] = cpu_seconds(child.pid)
    os.close(terminal)
    if child.wait() != 0:
        raise SystemExit(f"smoke failed:\n{seen.decode(errors='replace')[-3000:]}")
    marks["end"] = time.perf_counter() - start
    return marks


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="TRAIN_STEPS of the smoke run")
    parser.add_argument("--repo", type=pathlib.Path, default=REPO, help="the checkout to time")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="smoke_start_cache_") as cache:
        for cache_state in ("cold", "warm"):
            marks = time_smoke(args.repo.resolve(), args.steps, cache)
            rows.append(
                f"| {cache_state} | {marks['first output']:.1f} | "
                f"{marks.get('first step', float('nan')):.1f} | "
                f"{marks.get('first step cpu', float('nan')):.1f} | {marks['end']:.1f} |"
            )
    print(f"`moe-jax smoke --gin.TRAIN_STEPS={args.steps}`, seconds from the process start")
    print(
        "| compilation cache | first output (s) | first step done (s) | CPU used by then (s) "
        "| whole command (s) |"
    )
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
