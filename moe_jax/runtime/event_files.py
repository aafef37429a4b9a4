"""TensorBoard event files: written one event at a time (:class:`EventWriter`), framed as
TFRecords (:func:`pack_records`, :func:`unpack_records`), and cut after a step
(:func:`drop_events_after`), through :mod:`moe_jax.storage` (local disk or ``gs://``).
"""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.histogram import summary_v2 as histogram_summary
from tensorboard.plugins.scalar import summary_v2 as scalar_summary

from moe_jax import storage


class EventWriter:
    """One TensorBoard event file (``<folder>/events.out.tfevents.<time>.<host>.<pid>.v2``)
    of scalar and histogram summaries, written through :class:`moe_jax.storage.AppendFile`
    so that it lives on a local disk or an object store alike."""

    def __init__(self, folder: str):
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.v2"
        )
        self.path = storage.join(folder, name)
        self._file = storage.AppendFile(self.path)
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        summary = summary_pb2.Summary()
        for tag, value in scalars.items():
            summary.value.extend(scalar_summary.scalar_pb(tag, value).value)
        self._write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def write_histograms(self, step: int, arrays: dict[str, np.ndarray]) -> None:
        summary = summary_pb2.Summary()
        for tag, value in arrays.items():
            summary.value.extend(
                histogram_summary.histogram_pb(tag, np.asarray(value, np.float64)).value
            )
        self._write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event: event_pb2.Event) -> None:
        self._file.append(pack_records([event.SerializeToString()]))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def drop_events_after(path: str, step: int) -> None:
    """Rewrites one TensorBoard event file without the events of steps after ``step`` (and
    without a torn last record)."""
    data = storage.read_bytes(path)
    records = unpack_records(data)
    kept = [r for r in records if event_pb2.Event.FromString(r).step <= step]
    packed = pack_records(kept)
    if packed != data:
        storage.write_bytes(path, packed)


def pack_records(records: list[bytes]) -> bytes:
    """TFRecord framing of ``records`` (TensorBoard's event files): per record its
    length (uint64 LE), the masked CRC32C of that, the bytes, their masked CRC32C."""
    out = bytearray()
    for record in records:
        header = struct.pack("<Q", len(record))
        out += (
            header
            + struct.pack("<I", _masked(header))
            + record
            + struct.pack("<I", _masked(record))
        )
    return bytes(out)


def unpack_records(data: bytes) -> list[bytes]:
    """The whole records of TFRecord-framed ``data``; a torn or corrupt tail (a writer
    killed mid-record) ends the list."""
    records, pos = [], 0
    while pos + 12 <= len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        end = pos + 12 + length + 4
        if struct.unpack("<I", data[pos + 8 : pos + 12])[0] != _masked(header) or end > len(data):
            break
        record = data[pos + 12 : pos + 12 + length]
        if struct.unpack("<I", data[end - 4 : end])[0] != _masked(record):
            break
        records.append(record)
        pos = end
    return records


def _masked(data: bytes) -> int:
    crc = storage.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
