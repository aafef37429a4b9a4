"""Test-session set-up shared by every test.

Runs before JAX is imported anywhere: 8 forced CPU devices (so mesh tests see a
(data, expert, model) mesh on a laptop), XLA:CPU's code generation without LLVM's
optimisations (as ``init_state`` compiles; the suite compiles hundreds of small programs
and runs them briefly, and compiling them takes about half as long: results agree with an
optimised build to rounding), and a persistent compilation cache so that a second run of
the suite compiles almost nothing. Subprocesses that set their own ``XLA_FLAGS`` (the
multi-process and compile-target tests) compile as users' runs do.
"""

from __future__ import annotations

import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parent.parent

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# gs:// tests: every GCS client of this process and its subprocesses points at a server on
# localhost (tests/gcs_server.py), set before TensorStore, epath or orbax are imported.
from tests import gcs_server  # noqa: E402

gcs_server.configure_environment()

import uuid  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def gcs_dir(request) -> str:
    """A fresh ``gs://`` folder on the test GCS server (started on first use)."""
    gcs_server.start()
    return f"gs://{gcs_server.BUCKET}/{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"
