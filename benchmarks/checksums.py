"""What the checkpoint integrity record costs: CRC32C of every file, per GiB.

    python benchmarks/checksums.py [--gib 1.0] [--dir /tmp]

Writes ``--gib`` GiB of random bytes as 64 MiB files (a checkpoint's array files), then
times, side by side in one run: reading them (``cat``-like, 8 MiB chunks), computing
their CRC32C (:func:`moe_jax.storage.file_info`, what ``train`` does after each save and
``eval``/``train`` before each restore), and listing their sizes only. The files are in
the page cache (just written), so this is the CPU cost; a cold read adds the disk's.
Prints seconds per GiB and the checksum's cost relative to reading the bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from moe_jax import storage

_FILE = 64 << 20


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _read_all(directory: str) -> None:
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            while f.read(8 << 20):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where to write the files (default: a temp dir)")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(dir=args.dir)
    try:
        count = max(1, int(args.gib * (1 << 30)) // _FILE)
        block = os.urandom(_FILE)
        for i in range(count):
            with open(os.path.join(directory, f"d{i:04d}"), "wb") as f:
                f.write(block)
        gib = count * _FILE / (1 << 30)
        read = _best(lambda: _read_all(directory))
        crc = _best(lambda: storage.file_info(directory))
        sizes = _best(lambda: storage.file_info(directory, checksums=False))
        print(f"{gib:.2f} GiB in {count} files of 64 MiB (page cache)")
        print(f"{'operation':<28} {'s/GiB':>8}")
        print(f"{'read every byte':<28} {read / gib:>8.3f}")
        print(f"{'size + CRC32C (integrity)':<28} {crc / gib:>8.3f}")
        print(f"{'sizes only':<28} {sizes / gib:>8.4f}")
        print(f"CRC32C record / plain read: {crc / read:.2f}x")
    finally:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
