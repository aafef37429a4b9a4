"""moe_jax.storage on a local disk and on gs:// (the test GCS server): the same behaviour."""

from __future__ import annotations

import os
import threading

import pytest

from moe_jax import storage


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path) -> str:
    return request.getfixturevalue("gcs_dir") if request.param == "gcs" else str(tmp_path)


def test_normalize_makes_local_paths_absolute_and_keeps_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.normalize("run1") == str(tmp_path / "run1")
    assert storage.normalize("~/x") == os.path.expanduser("~/x")
    assert storage.normalize("gs://bkt/run/") == "gs://bkt/run"
    assert storage.is_local("run1") and not storage.is_local("gs://bkt/run")


def test_the_bucket_of_a_gcs_url_and_of_nothing_else():
    assert storage.gcs_bucket("gs://bkt/run/checkpoints") == "bkt"
    assert storage.gcs_bucket("gs://bkt") == "bkt"
    assert storage.gcs_bucket("s3://bkt/run") is None
    assert storage.gcs_bucket("/tmp/gs://x") is None and storage.gcs_bucket("run1") is None


def test_whole_writes_reads_listing_and_moves(root):
    path = storage.join(root, "a", "config.gin")
    storage.write_text(path, "x = 1\n")
    storage.write_text(path, "x = 2\n")
    assert storage.read_text(path) == "x = 2\n"
    assert storage.listdir(storage.join(root, "a")) == ["config.gin"]
    storage.write_bytes(storage.join(root, "a", "b", "c.bin"), b"12345")
    info = storage.file_info(storage.join(root, "a"))
    assert info["b/c.bin"]["size"] == 5
    assert info["b/c.bin"]["crc32c"] == f"{storage.crc32c(b'12345'):08x}"
    storage.move(storage.join(root, "a", "b"), storage.join(root, "aside", "b"))
    assert not storage.exists(storage.join(root, "a", "b", "c.bin"))
    assert storage.read_bytes(storage.join(root, "aside", "b", "c.bin")) == b"12345"
    if storage.is_local(root):
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_create_exclusive_has_one_winner(root):
    path = storage.join(root, "LOCK")
    results: list[bool] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(storage.create_exclusive(path, b"%d" % i))
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]
    assert storage.create_exclusive(path, b"again") is False


def test_append_file_continues_and_is_whole_on_every_store(root):
    path = storage.join(root, "metrics.jsonl")
    log = storage.AppendFile(path, remote_flush_sec=0)
    log.append(b"one\n")
    assert storage.read_bytes(path) == b"one\n"
    log.close()
    log = storage.AppendFile(path, remote_flush_sec=3600)
    log.append(b"two\n")
    log.close()
    assert storage.read_bytes(path) == b"one\ntwo\n"
