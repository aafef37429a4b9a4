"""TensorStore's C++ auth provider names the credentials it uses when a process first reaches
``gs://``; :func:`moe_jax.runtime.store_credentials.open_quietly` (called by every
``Checkpointer``) keeps that line out of a run's output, and the store still works."""

from __future__ import annotations

import subprocess
import sys

# orbax's array write, reduced: a zarr array written and read back through TensorStore's gcs
# driver, after ``open_quietly`` or not
_WRITER = """
import sys
import numpy as np
import tensorstore as ts
from moe_jax.runtime import store_credentials

path, mode = sys.argv[1], sys.argv[2]
if mode == "quiet":
    store_credentials.open_quietly(path)
bucket, _, folder = path.removeprefix("gs://").partition("/")
spec = {"driver": "zarr", "kvstore": {"driver": "gcs", "bucket": bucket, "path": folder + "/a/"}}
array = ts.open(spec, create=True, dtype=ts.float32, shape=[4]).result()
array.write(np.arange(4, dtype=np.float32)).result()
print("read back", array.read().result().tolist())
"""


def _write(path: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _WRITER, path, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_the_credentials_line_is_dropped_and_the_store_still_works(gcs_dir):
    loud = _write(f"{gcs_dir}/loud", "loud")
    assert "google_auth_provider" in loud.stderr  # what a run printed before
    quiet = _write(f"{gcs_dir}/quiet", "quiet")
    assert "google_auth_provider" not in quiet.stderr, quiet.stderr
    assert "read back [0.0, 1.0, 2.0, 3.0]" in quiet.stdout
