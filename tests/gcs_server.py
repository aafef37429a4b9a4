"""A GCS protocol server on localhost for the ``gs://`` tests (``gcp-storage-emulator``).

:func:`configure_environment` (called by ``tests/conftest.py`` before anything imports
TensorStore, epath or orbax) picks a free port and points every client at it, for the test
process and the subprocesses it starts:

* ``STORAGE_EMULATOR_HOST``: gcsfs (the project's files, orbax's metadata, via epath);
* ``TENSORSTORE_GCS_HTTP_URL`` + ``GOOGLE_AUTH_TOKEN_FOR_TESTING``: TensorStore's ``gcs``
  driver (checkpoint arrays);
* ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: no bucket-type lookup on Google's control
  plane (which needs credentials and network; the plain GCS client is what is tested).

:func:`start` serves an in-memory bucket :data:`BUCKET` there. The emulator does not check
upload preconditions; :func:`_insert_with_preconditions` adds ``ifGenerationMatch`` to
object inserts, as GCS has it (the run lock's atomic create relies on it).

Not covered by these tests: TensorFlow's ``gfile`` (it ignores these variables). The
project writes run directories through fsspec and TensorStore only; the data pipeline's
``gs://`` reads (TFDS, text files) go through ``gfile`` on real GCS.
"""

from __future__ import annotations

import logging
import os
import socket
from http import HTTPStatus

BUCKET = "moe-jax-test"
_server = None


def configure_environment() -> int:
    """Chooses the port and sets the clients' variables (once per process; subprocesses
    inherit them). Returns the port."""
    if "MOE_JAX_TEST_GCS_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MOE_JAX_TEST_GCS_PORT"] = str(sock.getsockname()[1])
    port = int(os.environ["MOE_JAX_TEST_GCS_PORT"])
    url = f"http://127.0.0.1:{port}"
    os.environ.update({
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "moe-jax-test",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "EPATH_USE_TF": "false",
    })
    return port


def start() -> None:
    """Starts the server on the configured port with an empty bucket :data:`BUCKET` (once
    per process)."""
    global _server
    if _server is not None:
        return
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    # Its handler threads log a traceback per client that closes a connection early.
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    _add_preconditions(server, objects)
    _server = server.create_server("127.0.0.1", configure_environment(), in_memory=True,
                                   default_bucket=BUCKET)
    _server.start()


def _add_preconditions(server, objects) -> None:
    plain = objects.insert
    if getattr(plain, "with_preconditions", False):
        return

    def insert(request, response, storage, *args, **kwargs):
        """Refuses (412) an insert whose ``ifGenerationMatch`` does not hold: ``0`` means
        "only if no live object has this name"; N, "only if its generation is N"."""
        wanted = request.query.get("ifGenerationMatch")
        if wanted:
            data = request.data if isinstance(request.data, dict) else {}
            name = (request.query.get("name", [None])[0] or data.get("meta", {}).get("name")
                    or data.get("name"))
            try:
                current = storage.get_file_obj(request.params["bucket_name"], name)["generation"]
            except Exception:  # the emulator's NotFound
                current = "0"
            if str(current) != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "Precondition Failed"}})
                return None
        return plain(request, response, storage, *args, **kwargs)

    insert.with_preconditions = True
    objects.insert = insert
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is plain:
                handlers[method] = insert
