"""Two JAX processes on one machine: per-host shards and the global batch (slow)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("_two_host_worker.py")
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multidevice
def test_two_hosts_read_different_shards_and_assemble_one_global_batch():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    results = [
        json.loads(line.split(" ", 1)[1])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]
    assert [p.returncode for p in procs] == [0, 0] and len(results) == 2
    assert sorted(tuple(r["shard"]) for r in results) == [(0, 2), (1, 2)]
    for r in results:
        assert r["global_shape"] == [8, 64]  # 2 hosts x per-host batch 4
        assert r["global_is_concat"] and r["hosts_differ"]
