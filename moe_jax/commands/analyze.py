"""`moe-jax analyze <analysis>`: routing analyses over a trained checkpoint.

    moe-jax analyze positions --checkpoint=MODEL_DIR/checkpoints/600 --out=/tmp/positions \\
        [--gin_file=...] [--gin.positions_script.analyze.num_batches=16]
    moe-jax analyze languages --checkpoint=RUN_A --checkpoint=RUN_B --all_steps --out=/tmp/languages
    moe-jax analyze trace --checkpoint=RUN --all_steps --out=/tmp/trace
    moe-jax analyze saturation --checkpoint=RUN --all_steps --out=/tmp/saturation
    moe-jax analyze vocabulary --checkpoint=RUN --trace=/tmp/trace   # read, not routed again

Gin: the analysis' defaults (``gin/analysis/<analysis>.gin``), then the run's
``MODEL_DIR/config.gin`` (written by `moe-jax train`; model and data), then ``--gin_file``
and ``--gin.NAME=VALUE`` flags, later ones overriding earlier ones
(``run_config.run_gin_files``, shared with eval, infer and export). Without a
``config.gin``, pass the run's gin files as for `moe-jax eval`. See docs/analysis.md.
"""

from __future__ import annotations

import sys

from moe_jax import storage
from moe_jax.commands.subcommands import split_command
from moe_jax.runtime import builders, distributed, gin_flags, gin_text, gin_utils, run_config

# analysis -> (module with ``analyze(checkpoint_path, out_dir)``, one-line help)
ANALYSES: dict[str, tuple[str, str]] = {
    "positions": (
        "moe_jax.analysis.positions",
        "positional routing: activation by position, "
        "correlation length, position probes (Bershatsky & Oseledets)",
    ),
    "languages": (
        "moe_jax.analysis.languages",
        "languages as latent clusters: I(language; expert) vs "
        "shuffled labels, sparsity per language vs a shuffled router, heatmaps, curves over steps",
    ),
    "trace": (
        "moe_jax.analysis.trace",
        "per-token routing records as Parquet: example, position, token and piece, label, "
        "layer, top-k experts and probabilities, dropped",
    ),
    "vocabulary": (
        "moe_jax.analysis.vocabulary",
        "token-id and token-category specialisation of the experts vs a random router "
        "(OpenMoE, OLMoE, ST-MoE)",
    ),
    "saturation": (
        "moe_jax.analysis.saturation",
        "top-1 / top-k agreement of every checkpoint with the final one, per layer (OLMoE)",
    ),
    "coactivation": (
        "moe_jax.analysis.coactivation",
        "expert pair co-activation per layer and cross-layer routing consistency (OLMoE)",
    ),
}
# Analyses reading per-token routing traces (gin defaults: gin/analysis/trace.gin).
TRACED = frozenset({"trace", "vocabulary", "saturation", "coactivation"})
# Analyses that can read a trace folder instead of routing the data again (``--trace``).
TRACE_READERS = frozenset({"vocabulary", "saturation", "coactivation"})
# Analyses taking several checkpoints (``--checkpoint`` repeated, ``--all_steps``).
MULTI_CHECKPOINT = frozenset({"languages"}) | TRACED
DEFAULTS_DIR = gin_text.REPO_GIN_DIR / "analysis"


def _defaults(analysis: str) -> list[str]:
    """The analysis' gin defaults: ``trace.gin`` for those reading traces, then its own
    file when it has one."""
    files = [DEFAULTS_DIR / "trace.gin"] if analysis in TRACED else []
    files += [DEFAULTS_DIR / f"{analysis}.gin"]
    return [str(f) for f in dict.fromkeys(files) if f.exists()]


def _usage() -> str:
    lines = [
        "usage: moe-jax analyze <analysis> --checkpoint=DIR[/checkpoints/STEP] [--out=DIR] "
        "[gin flags]",
        "",
        "analyses:",
    ]
    lines += [f"  {name:<12} {help_text}" for name, (_, help_text) in ANALYSES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import importlib

    import gin

    picked = split_command(
        list(sys.argv[1:] if argv is None else argv),
        ANALYSES,
        "moe-jax analyze",
        _usage(),
        what="analysis",
    )
    if isinstance(picked, int):
        return picked
    analysis, rest = picked
    with gin.unlock_config():  # its gin configurables register on import (a config may be locked)
        module = importlib.import_module(ANALYSES[analysis][0])
    parser = builders.build_parser(f"moe-jax analyze {analysis}", ANALYSES[analysis][1])
    parser.add_argument(
        "--checkpoint",
        type=storage.normalize,
        required=True,
        action="append",
        metavar="DIR[/checkpoints/STEP]",
        help="a MODEL_DIR (latest step), MODEL_DIR/STEP or MODEL_DIR/checkpoints/STEP"
        + ("; repeat for several (runs of one model)" if analysis in MULTI_CHECKPOINT else ""),
    )
    if analysis in MULTI_CHECKPOINT:
        parser.add_argument(
            "--all_steps",
            action="store_true",
            help="every saved step of each --checkpoint's run (curves over steps)",
        )
    parser.add_argument(
        "--out",
        type=storage.normalize,
        default=None,
        metavar="DIR",
        help="output directory (default: MODEL_DIR/analysis)",
    )
    if analysis in TRACE_READERS:
        parser.add_argument(
            "--trace",
            type=storage.normalize,
            default=None,
            metavar="DIR",
            help="read the checkpoints' routing from this folder of `moe-jax analyze trace` "
            "instead of routing the data again",
        )
    args = gin_flags.parse_flags(parser, rest)
    if analysis not in MULTI_CHECKPOINT and len(args.checkpoint) > 1:
        parser.error(f"{analysis} takes one --checkpoint")
    args.gin_file = run_config.run_gin_files(
        args,
        args.checkpoint[0],
        _defaults(analysis),
        extend_run_config=True,
        command=f"moe-jax analyze {analysis}",
    )
    distributed.initialize(args)
    gin_utils.parse_gin(args)
    if analysis in TRACE_READERS:
        module.analyze(args.checkpoint, args.out, args.all_steps, args.trace)
    elif analysis in MULTI_CHECKPOINT:
        module.analyze(args.checkpoint, args.out, args.all_steps)
    else:
        module.analyze(args.checkpoint[0], args.out)
    return 0
