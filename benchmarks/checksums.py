"""What the checkpoint integrity record costs: CRC32C of every file, per GiB.

    python benchmarks/checksums.py [--gib 1.0] [--dir /tmp]

Writes ``--gib`` GiB of random bytes as 64 MiB files (a checkpoint's array files), then
times, side by side in one run: reading them (``cat``-like, 8 MiB chunks), computing
their CRC32C (:func:`moe_jax.storage.file_info`, what ``train`` does after each save and
``eval``/``train`` before each restore), and listing their sizes only. The files are in
the page cache (just written), so this is the CPU cost; a cold read adds the disk's.
Prints seconds per GiB, what that makes for a T5-Base MoE checkpoint, and the checksum's
cost relative to reading the bytes. On GCS the record costs one object listing (the
server keeps each object's CRC32C).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from moe_jax import storage

_FILE = 64 << 20
# gin/experiments/base_learned.gin: 1,460,206,848 float32 parameters and two Adam moments
# (benchmarks/compile_reports/base_learned__v5p-32.json), as saved by one checkpoint.
BASE_CHECKPOINT_BYTES = 3 * 4 * 1_460_206_848


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
    parser.add_argument(
        "--dir", default=None, help="where to write the files (default: a temp dir)"
    )
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
        base = BASE_CHECKPOINT_BYTES / (1 << 30)
        print(f"{gib:.2f} GiB in {count} files of 64 MiB, in the page cache\n")
        print("| operation | s/GiB | T5-Base MoE checkpoint (s) |")
        print("|---|---|---|")
        for name, seconds in (
            ("read every byte", read),
            ("size + CRC32C (the integrity record)", crc),
            ("sizes only", sizes),
        ):
            print(f"| {name} | {seconds / gib:.4f} | {seconds / gib * base:.2f} |")
        print(
            f"\nCRC32C record / plain read: {crc / read:.2f}x; T5-Base MoE checkpoint "
            f"(float32 parameters + Adam moments): {base:.1f} GiB"
        )
    finally:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
