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
upload preconditions and sends no generation with a download; :func:`_add_gcs_semantics`
adds both as GCS has them: ``ifGenerationMatch`` on inserts (the run lock's atomic create
relies on it) and the ``x-goog-generation`` header of a download (TensorStore's OCDBT
manifest updates read it).

Not covered by these tests: TensorFlow's ``gfile`` (it ignores these variables). The
project writes run directories through fsspec and TensorStore only; the data pipeline's
``gs://`` reads (TFDS, text files) go through ``gfile`` on real GCS.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from http import HTTPStatus
from typing import Any

BUCKET = "moe-jax-test"


def configure_environment() -> int:
    """Chooses the port and sets the clients' variables (once per test process; the
    subprocesses a test starts inherit them). Returns the port.

    Each pytest-xdist worker serves its own port: workers inherit the controller's
    environment, so a port chosen there (or by another worker) is not taken over."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if os.environ.get("MOE_JAX_TEST_GCS_WORKER") != worker:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MOE_JAX_TEST_GCS_PORT"] = str(sock.getsockname()[1])
        os.environ["MOE_JAX_TEST_GCS_WORKER"] = worker
    port = int(os.environ["MOE_JAX_TEST_GCS_PORT"])
    url = f"http://127.0.0.1:{port}"
    os.environ.update(
        {
            "STORAGE_EMULATOR_HOST": url,
            "TENSORSTORE_GCS_HTTP_URL": url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "moe-jax-test",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "EPATH_USE_TF": "false",
        }
    )
    return port


@functools.cache
def start() -> Any:
    """Starts the server on the configured port with an empty bucket :data:`BUCKET` (once
    per process: later calls return the same server)."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    # Its handler threads log a traceback per client that closes a connection early.
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    _add_gcs_semantics(server, objects)
    emulator = server.create_server(
        "127.0.0.1", configure_environment(), in_memory=True, default_bucket=BUCKET
    )
    emulator._api.daemon = True
    emulator.start()
    # a client that closes a connection early (a killed trainer) is not the server's error
    emulator._api._httpd.handle_error = lambda request, address: None
    return emulator


def _add_gcs_semantics(server, objects) -> None:
    if getattr(objects.insert, "with_gcs_semantics", False):
        return
    _replace(server, objects, "insert", _with_preconditions(objects.insert))
    _replace(server, objects, "download", _with_generation_header(objects.download))


def _replace(server, objects, name: str, handler) -> None:
    plain = getattr(objects, name)
    handler.with_gcs_semantics = True
    setattr(objects, name, handler)
    for _, handlers in server.HANDLERS:
        for method, known in list(handlers.items()):
            if known is plain:
                handlers[method] = handler


def _with_generation_header(plain):
    def download(request, response, storage, *args, **kwargs):
        """A download, with the object's ``x-goog-generation`` / ``x-goog-metageneration``."""
        plain(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

    return download


def _with_preconditions(plain):
    def insert(request, response, storage, *args, **kwargs):
        """Refuses (412) an insert whose ``ifGenerationMatch`` does not hold: ``0`` means
        "only if no live object has this name"; N, "only if its generation is N"."""
        wanted = request.query.get("ifGenerationMatch")
        if wanted:
            data = request.data if isinstance(request.data, dict) else {}
            name = (
                request.query.get("name", [None])[0]
                or data.get("meta", {}).get("name")
                or data.get("name")
            )
            try:
                current = storage.get_file_obj(request.params["bucket_name"], name)["generation"]
            except Exception:  # the emulator's NotFound
                current = "0"
            if str(current) != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "Precondition Failed"}})
                return None
        return plain(request, response, storage, *args, **kwargs)

    return insert
