"""A run's progress on the terminal or in a log: a progress bar, or one timestamped line per
logged step and evaluation (``--progress``).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

PROGRESS_STYLES = ("auto", "bar", "lines")


def timestamp() -> str:
    """The UTC time of a log line, ``2026-01-31T12:00:05Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """``--progress={auto,bar,lines}`` of the commands that train (:class:`Progress`)."""
    parser.add_argument(
        "--progress",
        choices=PROGRESS_STYLES,
        default="auto",
        help="bar: a progress bar; lines: a timestamped line per logged step and eval (for "
        "cluster logs); auto (default): the bar on a terminal, else lines",
    )


class Progress:
    """A run's progress on process 0 (silent elsewhere): a tqdm bar with ETA on a terminal;
    where stderr is not one (a sweep's ``log.txt``, a SLURM log) or with ``style='lines'``,
    one plain timestamped line per logged step and per evaluation."""

    def __init__(self, start: int, total: int, style: str = "auto"):
        if style not in PROGRESS_STYLES:
            raise ValueError(f"progress style {style!r}; expected one of {PROGRESS_STYLES}")
        self.total = total
        self.enabled = jax.process_index() == 0
        self.lines = style == "lines" or (style == "auto" and not sys.stderr.isatty())
        self._bar = None
        if self.enabled and not self.lines:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=start,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0,
            )

    def update(self) -> None:
        """One step done."""
        if self._bar is not None:
            self._bar.update(1)

    def log(self, step: int, loss: float, tokens_per_sec: float) -> None:
        """A logged step's loss and throughput."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_sec:.0f}")
        else:
            self.write(f"step {step}/{self.total}: loss {loss:.4f}, {tokens_per_sec:,.0f} tokens/s")

    def write(self, message: str) -> None:
        """A line of its own (above the bar on a terminal; timestamped in lines)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(f"[moe-jax] {timestamp()} {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
