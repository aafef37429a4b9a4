"""The `moe-jax` console entry point: one subcommand per binary.

Each subcommand lives in its own module and exposes ``main(argv: list[str]) -> int`` (or
the function named after a colon: ``module:function``).
Modules are imported lazily so that `moe-jax --help` and the synthetic laboratory do not
pay for importing TensorFlow/seqio.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Collection

# subcommand -> (module path, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "synthetic": ("moe_jax.synthetic.cli", "regenerate the paper's synthetic experiments"),
    "train": ("moe_jax.train.train", "T5X-style gin-configured training"),
    "eval": ("moe_jax.train.evaluate", "evaluate one or more checkpoints"),
    "infer": ("moe_jax.train.infer", "decode from a checkpoint"),
    "analyze": ("moe_jax.analysis.cli", "routing analyses over a checkpoint"),
    "sweep": ("moe_jax.train.sweep", "expand an experiment family into runs; collect plots"),
    "smoke": ("moe_jax.smoke", "the README's main job on embedded defaults"),
    "upcycle": ("moe_jax.train.upcycle", "an MoE run from a dense run's checkpoint (sparse upcycling)"),
    "export": ("moe_jax.train.export:export_main", "write a checkpoint as safetensors + JSON"),
    "import": ("moe_jax.train.export:import_main", "read an export into a new run directory"),
}


def _usage() -> str:
    lines = ["usage: moe-jax <command> [options]", "", "commands:"]
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<10} {help_text}")
    lines.append("")
    lines.append("`moe-jax <command> --help` for the options of one command.")
    return "\n".join(lines)


def split_command(argv: list[str], known: Collection[str], prog: str, usage: str,
                  what: str = "command") -> tuple[str, list[str]] | int:
    """``(name, rest)`` of a ``prog <name> [options]`` command line, or an exit code once
    ``usage`` is printed: 0 for no name or help, 2 for a name not in ``known``."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage)
        return 0
    if argv[0] not in known:
        print(f"{prog}: unknown {what} {argv[0]!r}\n\n{usage}", file=sys.stderr)
        return 2
    return argv[0], argv[1:]


def main(argv: list[str] | None = None) -> int:
    picked = split_command(list(sys.argv[1:] if argv is None else argv), SUBCOMMANDS, "moe-jax", _usage())
    if isinstance(picked, int):
        return picked
    name, rest = picked
    module_name, _, function = SUBCOMMANDS[name][0].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            print(f"moe-jax: command {name!r} is not built yet ({module_name} missing)", file=sys.stderr)
            return 2
        raise
    return int(getattr(module, function or "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
