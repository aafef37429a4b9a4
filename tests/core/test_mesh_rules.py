"""Mesh construction and logical-axis rules (moe_jax.partitioning)."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec

from moe_jax import partitioning


def test_make_mesh_fills_the_free_axis_with_the_remaining_devices():
    mesh = partitioning.make_mesh((2, -1, 2))
    assert mesh.axis_names == ("data", "expert", "model")
    assert dict(mesh.shape) == {"data": 2, "expert": len(jax.devices()) // 4, "model": 2}


def test_make_mesh_gives_data_what_the_experts_cannot_use():
    devices = len(jax.devices())  # 8 forced CPU devices
    mesh = partitioning.make_mesh((1, -1, 1), max_expert_partitions=devices // 2)
    assert dict(mesh.shape) == {"data": 2, "expert": devices // 2, "model": 1}
    assert (
        dict(partitioning.make_mesh((1, -1, 1), max_expert_partitions=64).shape)["expert"]
        == devices
    )
    with pytest.raises(ValueError, match="max_expert_partitions"):
        partitioning.make_mesh((1, -1, 1), max_expert_partitions=3)


@pytest.mark.parametrize("shape", [(3, 1, 1), (-1, -1, 1), (3, -1, 1), (8, 1)])
def test_make_mesh_refuses_shapes_that_do_not_tile_the_devices(shape):
    with pytest.raises(ValueError, match="mesh_shape"):
        partitioning.make_mesh(shape)


def test_standard_rules_shard_experts_batch_and_mlp():
    mesh = partitioning.make_mesh((2, 2, 2))
    rules = partitioning.standard_logical_axis_rules()
    expert_w = partitioning.logical_to_sharding(("expert", "embed", "mlp"), mesh, rules)
    acts = partitioning.logical_to_sharding(("batch", "length", "embed"), mesh, rules)
    assert expert_w.spec == PartitionSpec("expert", None, "model")
    assert acts.spec == PartitionSpec(("data", "expert"), None, None)


def test_rules_without_expert_parallelism_replicate_experts():
    mesh = partitioning.make_mesh((8, 1, 1))
    rules = partitioning.standard_logical_axis_rules(expert_parallel=False, tensor_parallel=False)
    spec = partitioning.logical_to_sharding(("expert", "embed", "mlp"), mesh, rules).spec
    assert spec == PartitionSpec(None, None, None)


def test_unknown_logical_axis_and_unknown_mesh_axis_are_named():
    mesh = partitioning.make_mesh((8, 1, 1))
    rules = partitioning.standard_logical_axis_rules()
    with pytest.raises(ValueError, match="'embd'"):
        partitioning.logical_to_sharding(("batch", "embd"), mesh, rules)
    with pytest.raises(ValueError, match="'tensor'"):
        partitioning.validate_rules((("mlp", "tensor"),), mesh)
