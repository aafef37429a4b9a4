"""One of two processes of tests/data/test_two_hosts.py (4 CPU devices each)."""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1])
)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from moe_jax import partitioning  # noqa: E402
from moe_jax.data import pipeline  # noqa: E402

with pipeline.TrainIterator(
    "mc4_span_corruption",
    {"inputs": 64, "targets": 16},
    batch_size=4,
    seed=0,
    shuffle_buffer_size=64,
) as it:
    local = next(it)
    shard = it.get_state()["shard_index"], it.get_state()["num_shards"]
mesh = partitioning.make_mesh((2, 4, 1))
global_batch = pipeline.to_global_batch(local, mesh)
tokens = global_batch["encoder_input_tokens"]
gathered = multihost_utils.process_allgather(tokens, tiled=True)
locals_ = multihost_utils.process_allgather(local["encoder_input_tokens"])
print(
    "RESULT",
    json.dumps(
        {
            "shard": shard,
            "global_shape": list(tokens.shape),
            "global_is_concat": bool(np.array_equal(gathered, np.concatenate(list(locals_)))),
            "hosts_differ": bool(not np.array_equal(locals_[0], locals_[1])),
        }
    ),
    flush=True,
)
