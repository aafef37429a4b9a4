"""`moe-jax smoke` (`make smoke`): the README's main job on embedded defaults.

Trains ``gin/runs/smoke_cpu.gin`` (tiny d_model 32 MoE T5, learned router, embedded
corpus, a few hundred steps on CPU), then evaluates the final checkpoint with the same gin
files and prints the evaluation table. Takes the train flags (``--gin.TRAIN_STEPS=50``,
``--gin.MODEL_DIR=...``; default MODEL_DIR: a fresh temporary directory).
"""

from __future__ import annotations

import sys
import tempfile
import time

from moe_jax.commands import evaluate, train
from moe_jax.runtime import builders, gin_flags, gin_utils, scratch
from moe_jax.runtime.progress import add_progress_flag


def _fresh_model_dir() -> str:
    """A new ``<tmp>/moe_jax_smoke_*`` folder, kept after the command ends."""
    return tempfile.mkdtemp(prefix="moe_jax_smoke_", dir=scratch.outer_tempdir())


def main(argv: list[str] | None = None) -> int:

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = builders.build_parser("moe-jax smoke", __doc__.splitlines()[0])
    add_progress_flag(parser)
    args = gin_flags.parse_flags(parser, ["--gin_file=runs/smoke_cpu.gin", *argv])
    if not any(b.replace(" ", "").startswith("MODEL_DIR=") for b in args.gin_dot_bindings):
        args.gin_dot_bindings.append(f"MODEL_DIR = {_fresh_model_dir()!r}")
    start = time.perf_counter()
    gin_utils.parse_gin(args)
    result = train.train(progress=args.progress)
    model_dir = result["model_dir"]
    evaluate.evaluate([model_dir])
    print(
        f"[moe-jax] smoke: {result['step']} steps, "
        f"final loss {result['losses'][result['step']]:.4f}, "
        f"total wall time {time.perf_counter() - start:.0f} s; run in {model_dir}",
        flush=True,
    )
    return 0
