"""Input pipeline throughput: packed rows/s and tokens/s of ``TrainIterator`` on this machine.

Usage::

    python benchmarks/input_pipeline.py [--task mc4_span_corruption] [--batch_size 32]
        [--batches 100] [--lengths 128,32 512,114] [--skip 200]

Reads the embedded corpus with the embedded vocabulary (the local default). For each feature
length pair it prints: packed rows (examples) per second, target-side and all non-padding
tokens per second, the fill of the packed rows, and the time to restore an iterator at step
``--skip`` (resumption by deterministic skipping). Steady state: the first batches (shuffle
buffer fill, tracing) are timed separately as start-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import seqio

from moe_jax.data.pipeline import TrainIterator


def measure(
    task: str, lengths: dict[str, int], batch_size: int, batches: int, skip: int
) -> dict[str, float]:
    start = time.perf_counter()
    with TrainIterator(
        task, lengths, batch_size, seed=0, shard_info=seqio.ShardInfo(0, 1), prefetch=4
    ) as it:
        next(it)
        startup = time.perf_counter() - start
        t0 = time.perf_counter()
        enc = dec = 0
        for _ in range(batches):
            batch = next(it)
            enc += int((batch["encoder_segment_ids"] > 0).sum())
            dec += int((batch["decoder_loss_weights"] > 0).sum())
        elapsed = time.perf_counter() - t0
        state = it.get_state()
    state["step"] = skip
    t0 = time.perf_counter()
    with TrainIterator.restore(state, prefetch=1) as resumed:
        next(resumed)
    restore = time.perf_counter() - t0
    rows = batches * batch_size
    return {
        "startup_s": startup,
        "rows_per_s": rows / elapsed,
        "target_tokens_per_s": dec / elapsed,
        "tokens_per_s": (enc + dec) / elapsed,
        "fill": (enc + dec) / (rows * (lengths["inputs"] + lengths["targets"])),
        "restore_s": restore,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mc4_span_corruption")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--lengths", nargs="+", default=["128,32", "512,114"])
    parser.add_argument("--skip", type=int, default=200)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"task {args.task}, per-host batch {args.batch_size}, {args.batches} batches timed"
    )
    print(
        "| inputs/targets | start-up s | packed rows/s | target tokens/s | tokens/s "
        f"| fill | restore at step {args.skip} s |"
    )
    print("|---|---|---|---|---|---|---|")
    for pair in args.lengths:
        i, t = (int(x) for x in pair.split(","))
        r = measure(
            args.task, {"inputs": i, "targets": t}, args.batch_size, args.batches, args.skip
        )
        print(
            f"| {i}/{t} | {r['startup_s']:.1f} | {r['rows_per_s']:.0f} | "
            f"{r['target_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {r['fill']:.2f} | "
            f"{r['restore_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
