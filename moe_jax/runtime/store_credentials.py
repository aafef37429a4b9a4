"""TensorStore's GCS credentials, opened once per process without their log line.

When TensorStore (orbax's array writer) first reaches ``gs://``, its C++ auth provider logs
which credentials it uses (``I... google_auth_provider.cc:...] Running on GCE, using service
account ...``, ``Using credentials at ...``) straight to the process's standard error, below
Python's logging and outside any flag TensorStore reads. The provider is shared by every
store of the process, so :func:`open_quietly` creates it once, by reading a key that does
not exist, inside :func:`moe_jax.hardware.native_output_hidden`: the line never reaches a
run's output. ``MOE_JAX_TRACEBACK=1`` keeps it.
"""

from __future__ import annotations

import functools
import os

from moe_jax import hardware, storage

_PROBE_KEY = ".moe-jax-credentials-probe"  # never written: reading it only authenticates
_PROBE_TIMEOUT_S = 60.0


def open_quietly(path: str) -> None:
    """Opens TensorStore's credentials for ``path``'s bucket with the native log line
    dropped (nothing for a local path, or for a bucket already probed). A failed
    probe is not reported here: the checkpoint read or write that follows reports it."""
    bucket = storage.gcs_bucket(path)
    if bucket is not None and not os.environ.get("MOE_JAX_TRACEBACK"):
        _probe(bucket)


@functools.cache
def _probe(bucket: str) -> None:
    import tensorstore as ts

    with hardware.native_output_hidden():
        try:
            store = ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result()
            store.read(_PROBE_KEY).result(timeout=_PROBE_TIMEOUT_S)
        except Exception:  # the save or restore that follows names the cause
            pass
