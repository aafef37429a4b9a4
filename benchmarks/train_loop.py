"""Train-loop throughput of the smoke config (`gin/runs/smoke_cpu.gin`) on this machine.

    .venv/bin/python benchmarks/train_loop.py [--steps 200] [more --gin.X=v flags]

Trains the smoke model in a temporary MODEL_DIR with metrics every 25 steps and prints
the median over logged windows (the first, which holds compilation, is left out) of
steps/s, tokens/s (encoder + decoder positions) and MFU, plus the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


def main(argv: list[str]) -> int:
    from moe_jax.train import gin_utils, setup, train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args, extra = parser.parse_known_args(argv)
    model_dir = tempfile.mkdtemp(prefix="moe_jax_bench_")
    flags = gin_utils.parse_flags(setup.build_parser("bench", "bench"), [
        "--gin_file=runs/smoke_cpu.gin", f"--gin.MODEL_DIR={model_dir}",
        f"--gin.TRAIN_STEPS={args.steps}", "--gin.train_script.train.log_period=25",
        "--gin.train_script.train.eval_period=0", *extra])
    gin_utils.parse_gin(flags)
    start = time.perf_counter()
    train.train()
    wall = time.perf_counter() - start
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"split": "train"' in line][1:]
    import jax

    print(f"| device | steps | steps/s | tokens/s | MFU | wall (s) |\n|---|---|---|---|---|---|\n"
          f"| {jax.devices()[0].device_kind} x{jax.device_count()} | {args.steps} "
          f"| {np.median([r['steps_per_sec'] for r in rows]):.2f} "
          f"| {np.median([r['tokens_per_sec'] for r in rows]):,.0f} "
          f"| {100 * np.median([r['mfu'] for r in rows]):.2f}% | {wall:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
