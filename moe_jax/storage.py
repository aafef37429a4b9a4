"""Files of a run directory, an export or a sweep root, on a local disk or an object store.

Every file the project reads or writes under ``MODEL_DIR``, ``--checkpoint``, ``--out``,
``--model_dir`` or a sweep root goes through this module, which is built on
:mod:`etils.epath` (the path library orbax uses). A path is a ``str``: a local path, or a
URL such as ``gs://bucket/run``. The one place that tells the two apart is
:func:`is_local`.

What each store offers, and what the functions here do with it:

============================  ==============================  ================================
operation                     local disk                      object store (``gs://``)
============================  ==============================  ================================
:func:`write_bytes` (whole)   temporary file, then rename     one object upload (atomic)
:func:`create_exclusive`      ``os.link`` of a finished file  upload with ``ifGenerationMatch=0``
:class:`AppendFile`           append and flush                the whole object re-uploaded
:func:`file_info` (checksum)  CRC32C computed from the bytes  CRC32C from the object listing
:func:`move`                  rename                          copy, then delete
============================  ==============================  ================================

A failed write (disk full, file-size limit, quota, permission) raises
:class:`moe_jax.errors.WriteFailedError` naming the file (exit code 74 at a command's top).

``gs://`` goes through fsspec's ``gcsfs`` (``EPATH_USE_TF=false``, set here unless the
environment sets it), not TensorFlow's ``gfile``: one client for the project's files and
orbax's metadata, and the one the tests run against a GCS protocol server
(``tests/gcs_server.py``). Array data of checkpoints is written by TensorStore's own GCS
driver (orbax).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("EPATH_USE_TF", "false")  # before epath picks its gs:// backend (once)

import fsspec
import numpy as np
from etils import epath

from moe_jax import errors

# No listing cache: a run directory is changed by other processes (a resumed trainer, a
# second trainer meeting the lock, eval beside a run), and a cached listing would hide that.
for _protocol in ("gs", "gcs"):
    fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)

PathLike = str | os.PathLike
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_CHUNK = 8 << 20


def is_local(path: PathLike) -> bool:
    """True for a path on a local (or mounted) file system, False for a URL (``gs://...``)."""
    return not _URL.match(os.fspath(path))


def gcs_bucket(path: PathLike) -> str | None:
    """The bucket of a ``gs://bucket/...`` URL; None for a local path or another store."""
    scheme, _, rest = str(path).partition("://")
    return rest.split("/", 1)[0] if scheme == "gs" and not is_local(path) else None


def normalize(path: PathLike) -> str:
    """A path as a run uses it: a URL as given without a trailing slash; a local path made
    absolute (``~`` expanded), so that it names the same place from any working directory
    and in any process the run starts."""
    text = os.fspath(path)
    if not is_local(text):
        return text.rstrip("/")
    return os.path.abspath(os.path.expanduser(text))


def join(base: PathLike, *parts: str) -> str:
    return os.fspath(epath.Path(base).joinpath(*parts))


def parent(path: PathLike) -> str:
    return os.fspath(epath.Path(path).parent)


def basename(path: PathLike) -> str:
    return epath.Path(path).name


def exists(path: PathLike) -> bool:
    return epath.Path(path).exists()


def isdir(path: PathLike) -> bool:
    return epath.Path(path).is_dir()


def listdir(path: PathLike) -> list[str]:
    """The names in directory ``path``, sorted ([] when it does not exist)."""
    p = epath.Path(path)
    if not p.is_dir():
        return []
    return sorted(child.name for child in p.iterdir())


def glob(path: PathLike, pattern: str) -> list[str]:
    return sorted(os.fspath(p) for p in epath.Path(path).glob(pattern))


def makedirs(path: PathLike) -> None:
    with _writing_to(path):
        epath.Path(path).mkdir(parents=True, exist_ok=True)


def read_bytes(path: PathLike) -> bytes:
    return epath.Path(path).read_bytes()


def read_text(path: PathLike) -> str:
    return epath.Path(path).read_text()


def write_bytes(path: PathLike, data: bytes) -> None:
    """Writes a whole file so that readers see the old content or the new, never a part:
    locally a temporary file renamed over ``path`` (mode as ``open`` gives, e.g. 0644);
    on an object store one upload. Creates missing parent directories."""
    path = os.fspath(path)
    with _writing_to(path):
        if not is_local(path):
            epath.Path(path).write_bytes(data)
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = _temporary_name(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def write_text(path: PathLike, text: str) -> None:
    write_bytes(path, text.encode())


@contextlib.contextmanager
def writing(path: PathLike) -> Iterator[io.BytesIO]:
    """``with writing(path) as f: ...``: a binary file object for writers that need one
    (``np.savez``, ``savefig``); its content is written whole (:func:`write_bytes`) when
    the block ends without an error."""
    buffer = io.BytesIO()
    yield buffer
    write_bytes(path, buffer.getvalue())


def save_npz(path: PathLike, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` of ``arrays``, written whole (:func:`write_bytes`)."""
    with writing(path) as f:
        np.savez(f, allow_pickle=True, **arrays)


def load_npz(path: PathLike) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(read_bytes(path))) as data:
        return {k: data[k] for k in data.files}


def create_exclusive(path: PathLike, data: bytes) -> bool:
    """Creates ``path`` holding ``data`` only if it does not exist (atomically: of two
    processes, one wins); False when it exists. Locally a finished temporary file is
    hard-linked to ``path``; on GCS the upload carries ``ifGenerationMatch=0``."""
    path = os.fspath(path)
    if not is_local(path):
        try:
            _fs(path).pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except (TypeError, ValueError) as err:  # an fsspec file system without mode="create"
            raise NotImplementedError(
                f"{path}: the store offers no atomic create ({err})"
            ) from None
        return True
    tmp = _temporary_name(path)
    try:
        with _writing_to(path), open(tmp, "wb") as f:
            f.write(data)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def modified_time(path: PathLike) -> float:
    """Seconds since the epoch of the last write of ``path`` (on GCS the object's
    ``updated`` time, by the server's clock)."""
    path = os.fspath(path)
    if is_local(path):
        return os.path.getmtime(path)
    info = _fs(path).info(path)
    stamp = info.get("mtime") or info.get("updated")
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def remove(path: PathLike) -> bool:
    """Deletes file ``path``; False when it did not exist."""
    try:
        epath.Path(path).unlink()
        return True
    except FileNotFoundError:
        return False


def rmtree(path: PathLike) -> None:
    p = epath.Path(path)
    if p.exists():
        p.rmtree()


def move(source: PathLike, dest: PathLike) -> None:
    """Moves a file or directory (locally a rename; on an object store every object is
    copied, then deleted)."""
    source, dest = os.fspath(source), os.fspath(dest)
    if is_local(source):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(source, dest)
        return
    fs = _fs(source)
    fs.copy(source, dest, recursive=True)  # server-side copies (the "rewrite" call)
    fs.rm(source, recursive=True)


def file_info(directory: PathLike, *, checksums: bool = True) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": bytes, "crc32c": "8 hex digits"}}`` of every file under
    ``directory`` (``crc32c`` only with ``checksums``). On GCS one listing gives both (the
    server's CRC32C of each object); locally each file is read once to compute it."""
    directory = os.fspath(directory)
    out: dict[str, dict[str, Any]] = {}
    if not is_local(directory):
        fs = _fs(directory)
        root = _strip_protocol(directory)
        for name, info in fs.find(directory, detail=True).items():
            entry: dict[str, Any] = {"size": int(info["size"])}
            if checksums and info.get("crc32c"):
                entry["crc32c"] = base64.b64decode(info["crc32c"]).hex()
            out[name[len(root) :].lstrip("/")] = entry
        return out
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            entry = {"size": os.path.getsize(path)}
            if checksums:
                entry["crc32c"] = crc32c_file(path)
            out[os.path.relpath(path, directory)] = entry
    return out


def crc32c_file(path: PathLike) -> str:
    """The CRC32C of a file's bytes as 8 hex digits (read in 8 MiB chunks)."""
    import google_crc32c  # deferred: only checksums need it, not every reader of this module

    checksum = google_crc32c.Checksum()
    with epath.Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            checksum.update(chunk)
    return checksum.hexdigest().decode()


def crc32c(data: bytes) -> int:
    """The CRC32C of ``data``."""
    import google_crc32c  # deferred: only checksums need it, not every reader of this module

    return google_crc32c.value(data)


class AppendFile:
    """A file that grows by appends (``metrics.jsonl``, TensorBoard event files), each
    append whole or not at all.

    Locally each :meth:`append` goes to the OS at once (unbuffered); one that fails part
    way (disk full, file-size limit) is cut off again (the file truncated to where the
    append began) before :class:`~moe_jax.errors.WriteFailedError` is raised. An object
    store cannot append: the content is kept in memory and the whole object re-uploaded by
    :meth:`flush` (every append, at most every ``remote_flush_sec`` seconds, and at
    :meth:`close`), so a reader sees a prefix of whole appends, never a torn one.
    Opening an existing file continues it.
    """

    def __init__(self, path: PathLike, *, remote_flush_sec: float = 10.0):
        self.path = os.fspath(path)
        self._local = is_local(self.path)
        self._remote_flush_sec = remote_flush_sec
        self._dirty = False
        self._last_flush = 0.0
        if self._local:
            with _writing_to(self.path):
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._fd: int | None = os.open(
                    self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666
                )
        else:
            self._data = bytearray(read_bytes(self.path) if exists(self.path) else b"")

    def append(self, data: bytes) -> None:
        if self._local:
            assert self._fd is not None, f"{self.path} is closed"
            start = os.fstat(self._fd).st_size
            rest = memoryview(data)
            try:
                while rest:
                    rest = rest[os.write(self._fd, rest) :]
            except OSError as err:
                with contextlib.suppress(OSError):  # shrinking passes any size limit
                    os.ftruncate(self._fd, start)
                raise errors.write_failed(self.path, err) from err
            return
        self._data += data
        self._dirty = True
        if time.monotonic() - self._last_flush >= self._remote_flush_sec:
            self.flush()

    def flush(self) -> None:
        """Uploads the content to an object store (a local file has nothing buffered)."""
        if not self._local and self._dirty:
            write_bytes(self.path, bytes(self._data))
            self._dirty = False
            self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._local and self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def _writing_to(path: PathLike) -> Iterator[None]:
    """Raises an ``OSError`` of the block as :class:`~moe_jax.errors.WriteFailedError`
    naming ``path``."""
    try:
        yield
    except errors.WriteFailedError:
        raise
    except OSError as err:
        raise errors.write_failed(path, err) from err


def _temporary_name(path: str) -> str:
    """A name beside ``path`` that no other writer (process or thread) uses."""
    return f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _strip_protocol(path: str) -> str:
    return _URL.sub("", path).rstrip("/")


def _fs(path: str) -> Any:
    """The fsspec file system of a URL (the client epath uses for it)."""
    return fsspec.filesystem(path.split("://", 1)[0])
