"""Train-loop throughput of the smoke config (`gin/runs/smoke_cpu.gin`) on this machine:
the loop that checks each loss one step late (the default) against the loop that waits for
every step (`train_script.train.sync_every_step=True`, the synchronous loop).

    .venv/bin/python benchmarks/train_loop.py [--steps 200] [--rounds 2] [--devices 8]
        [more --gin.X=v flags]

Runs the two loops alternately (`--rounds` times each, so both see the same machine load),
each training the smoke model from scratch in a temporary MODEL_DIR with metrics every 25
steps, on `--devices` forced CPU devices (data parallel over all of them). Prints per loop
the median over logged windows (the first, which holds compilation, is left out) of
steps/s, tokens/s (encoder + decoder positions) and MFU, and the ratio of steps/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

LOOPS = {"every step (before)": True, "one step late": False}  # sync_every_step


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each loop, alternated")
    parser.add_argument("--devices", type=int, default=8, help="forced CPU devices")
    args, extra = parser.parse_known_args(argv)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    import jax

    from moe_jax.commands import train
    from moe_jax.runtime import builders, gin_flags, gin_utils
    from moe_jax.runtime.metrics import read_metrics
    from moe_jax.runtime.run_dir import RunDir

    windows: dict[str, list[dict]] = {name: [] for name in LOOPS}
    for round_index in range(args.rounds):
        for name, sync in LOOPS.items():
            model_dir = tempfile.mkdtemp(prefix="moe_jax_bench_")
            flags = gin_flags.parse_flags(
                builders.build_parser("bench", "bench"),
                [
                    "--gin_file=runs/smoke_cpu.gin",
                    f"--gin.MODEL_DIR={model_dir}",
                    f"--gin.TRAIN_STEPS={args.steps}",
                    "--gin.train_script.train.log_period=25",
                    "--gin.train_script.train.eval_period=0",
                    f"--gin.train_script.train.checkpoint_period={args.steps}",
                    f"--gin.train_script.train.sync_every_step={sync}",
                    *extra,
                ],
            )
            gin_utils.parse_gin(flags)
            train.train()
            records = read_metrics(RunDir(model_dir), "train")[1:]
            windows[name] += records
            rate = np.median([w["steps_per_sec"] for w in records])
            print(f"round {round_index + 1}: {name}: {rate:.2f} steps/s", file=sys.stderr)

    print(
        f"{jax.devices()[0].device_kind} x{jax.device_count()}, {args.steps} steps x "
        f"{args.rounds} rounds per loop, medians over 25-step windows"
    )
    print("| loss check | steps/s | tokens/s | MFU |\n|---|---|---|---|")
    rates = {}
    for name, rows in windows.items():
        rates[name] = np.median([r["steps_per_sec"] for r in rows])
        print(
            f"| {name} | {rates[name]:.2f} | {np.median([r['tokens_per_sec'] for r in rows]):,.0f} "
            f"| {100 * np.median([r['mfu'] for r in rows]):.2f}% |"
        )
    before, after = rates.values()
    print(f"one step late / every step: {after / before:.3f}x steps/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
