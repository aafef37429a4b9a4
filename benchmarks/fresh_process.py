"""A measurement in a fresh Python process: the repository importable, JAX's persistent
compilation cache off, no inherited ``XLA_FLAGS`` (each target sets its own device count);
its result is the last JSON line the child prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env() -> dict[str, str]:
    """The child's environment."""
    child = dict(os.environ, MOE_JAX_COMPILATION_CACHE="0")
    child.pop("JAX_COMPILATION_CACHE_DIR", None)
    child.pop("XLA_FLAGS", None)
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, child.get("PYTHONPATH")]))
    return child


def run_json(script: str, *args: str) -> dict:
    """The last JSON line ``python script args...`` prints, run from the repository root.

    Raises:
      RuntimeError: with the child's output, when it fails or prints no JSON line.
    """
    cmd = [sys.executable, os.path.abspath(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return json.loads(lines[-1])
