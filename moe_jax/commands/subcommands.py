"""Picking a subcommand from a command line: ``moe-jax <command>`` and
``moe-jax analyze <analysis>``."""

from __future__ import annotations

import sys
from collections.abc import Collection


def split_command(
    argv: list[str], known: Collection[str], prog: str, usage: str, what: str = "command"
) -> tuple[str, list[str]] | int:
    """``(name, rest)`` of a ``prog <name> [options]`` command line, or an exit code once
    ``usage`` is printed: 0 for no name or help, 2 for a name not in ``known``."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage)
        return 0
    if argv[0] not in known:
        print(f"{prog}: unknown {what} {argv[0]!r}\n\n{usage}", file=sys.stderr)
        return 2
    return argv[0], argv[1:]
