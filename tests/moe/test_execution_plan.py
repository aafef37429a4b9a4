"""``execution.resolve_plan``: the documented choice per platform of the mesh's devices (not
``jax.default_backend()``, CPU in these tests), and a layer that traces exactly its plan."""

from __future__ import annotations

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from moe_jax.compile import targets
from moe_jax.moe import ExecutionConfig, ExpertChoiceRouterConfig, MoeLayer, RouterConfig
from moe_jax.moe.collections import AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION
from moe_jax.moe.execution import (
    ExecutionPlan,
    resolve_plan,
    target_platform,
)
from tests.moe.moe_testlib import SMALL, make_inputs, with_execution

AXES = ("data", "expert", "model")


def _abstract_mesh(platform: str | None, shape: tuple[int, int, int] = (1, 1, 1)) -> AbstractMesh:
    device = (
        None
        if platform is None
        else AbstractDevice(device_kind=f"{platform} chip", num_cores=1, platform=platform)
    )
    return AbstractMesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, abstract_device=device)


def _jaxpr(layer: MoeLayer, mesh: AbstractMesh | None):
    x = make_inputs()
    params = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)

    def forward(p, x):
        return layer.apply(p, x, mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION])[0]

    if mesh is None:
        return jax.make_jaxpr(forward)(params, x)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.make_jaxpr(forward)(params, x)


def _primitives(layer: MoeLayer, mesh: AbstractMesh | None) -> set[str]:
    """Top-level primitives of the traced layer (``scan`` = per-expert loop, ``scatter`` =
    the sort dispatch's position scatter; the einsum dispatch has neither)."""
    return {eqn.primitive.name for eqn in _jaxpr(layer, mesh).jaxpr.eqns}


def _plan(
    platform,
    dtype="bfloat16",
    shape=(1, 1, 1),
    *,
    dropless: bool = False,
    router: RouterConfig = SMALL.router,
    **execution,
) -> ExecutionPlan:
    """The plan of SMALL with ``dropless``, ``router`` and the ``ExecutionConfig`` fields
    ``execution``, on a mesh of ``shape`` of ``platform`` devices."""
    config = replace(
        SMALL,
        router=router,
        capacity=replace(SMALL.capacity, dropless=dropless),
        execution=ExecutionConfig(**execution),
    )
    return resolve_plan(config, _abstract_mesh(platform, shape), dtype)


def test_resolve_plan_gives_the_documented_choice_per_platform():
    # sort everywhere; per-expert loop on CPU, and on TPU for float32; choice-major combine
    # on TPU and GPU; the platform comes from the mesh's devices, or is named
    for dtype in ("bfloat16", jnp.float32):
        cpu, gpu = _plan("cpu", dtype), _plan("gpu", dtype)
        assert cpu == ExecutionPlan("cpu", "sort", True, False, "local")
        assert gpu == ExecutionPlan("gpu", "sort", False, True, "local", gather_gradients=True)
    tpu = dict(scatter_rows=True)  # row moves scatter on TPU
    assert _plan("tpu", "bfloat16") == ExecutionPlan("tpu", "sort", False, True, "local", **tpu)
    assert _plan("tpu", "float32") == ExecutionPlan("tpu", "sort", True, True, "local", **tpu)
    for gpu in ("gpu", "cuda", "rocm"):
        assert resolve_plan(SMALL, gpu, "float32") == _plan("gpu", "float32")
    assert resolve_plan(SMALL, None, "float32") == _plan("cpu", "float32")  # default device
    with pytest.raises(ValueError, match="platform"):
        resolve_plan(SMALL, "metal", "float32")
    # explicit options win; what a path does not use is False
    assert _plan("cpu", dispatch="einsum") == ExecutionPlan("cpu", "einsum", True, False, "local")
    assert _plan("tpu", dispatch="einsum").choice_major_combine is False
    assert _plan("gpu", per_expert_loop=True).per_expert_loop is True
    assert _plan("tpu", router=ExpertChoiceRouterConfig()).choice_major_combine is False
    # gradients of the row moves gather on GPU (elsewhere scatter-add); einsum has no moves
    assert _plan("tpu", gather_gradients=True).gather_gradients is True
    assert _plan("tpu", gather_gradients=True).scatter_rows is False  # gathers both ways
    assert _plan("tpu", dispatch="einsum").scatter_rows is False
    assert not _plan("cpu").scatter_rows and not _plan("gpu", gather_gradients=False).scatter_rows
    assert _plan("gpu", scatter_rows=True) == ExecutionPlan(
        "gpu", "sort", False, True, "local", scatter_rows=True
    )
    with pytest.raises(ValueError, match=r"scatter_rows=True and gather_gradients=True"):
        _plan("tpu", scatter_rows=True, gather_gradients=True)
    assert _plan("gpu", gather_gradients=False).gather_gradients is False
    assert _plan("gpu", dispatch="einsum", gather_gradients=True).gather_gradients is False
    # dropless: jax.lax.ragged_dot, except a GPU step on a GPU (tokamax Triton); a GPU target
    # compiled from this CPU host keeps xla (tokamax checks its own device); explicit wins
    assert _plan("cpu", dropless=True) == ExecutionPlan(
        "cpu", "ragged", False, False, "local", "xla"
    )
    assert _plan("tpu", dropless=True).grouped_matmul == "xla"
    assert _plan("gpu", dropless=True) == ExecutionPlan(
        "gpu", "ragged", False, False, "local", "xla", gather_gradients=True
    )
    assert _plan("gpu", dropless=True, grouped_matmul="triton").grouped_matmul == "triton"
    assert _plan("gpu", dropless=True, grouped_matmul="pallas").grouped_matmul == "pallas"
    assert _plan("gpu", grouped_matmul="triton").grouped_matmul is False  # not ragged
    with pytest.raises(ValueError, match="grouped_matmul"):
        _plan("gpu", dropless=True, grouped_matmul="cublas")


def test_resolve_plan_gathers_in_the_kernel_only_with_pallas_off_tpu_and_locally():
    # the pallas kernels take a row index; the other kernels run on the sorted copy
    for platform in ("cpu", "gpu"):
        assert _plan(platform, dropless=True, grouped_matmul="pallas").gather_in_kernel
        assert not _plan(platform, dropless=True).gather_in_kernel
        assert not _plan(platform, dropless=True, grouped_matmul="triton").gather_in_kernel
        assert not _plan(platform, grouped_matmul="pallas").gather_in_kernel  # not ragged
    assert not _plan("tpu", dropless=True, grouped_matmul="pallas").gather_in_kernel
    # under expert parallelism the rows cross devices sorted (TPU) or the path is padded
    for platform in ("cpu", "gpu", "tpu"):
        plan = _plan(platform, shape=(2, 4, 1), dropless=True, grouped_matmul="pallas")
        assert not plan.gather_in_kernel


def test_resolve_plan_exchange_under_expert_parallelism():
    ep = (2, 4, 1)
    for platform in ("cpu", "gpu", "tpu"):
        assert _plan(platform, shape=ep).exchange == "all_to_all"
        assert _plan(platform, shape=(4, 1, 2)).exchange == "local"  # expert axis of size 1
    # dropless: rows cross the expert axis on TPU; padded buffers on CPU and GPU
    assert _plan("tpu", shape=ep, dropless=True) == ExecutionPlan(
        "tpu", "ragged", False, False, "ragged_all_to_all", "xla", scatter_rows=True
    )
    for platform in ("cpu", "gpu"):
        plan = _plan(platform, shape=ep, dropless=True)
        assert (plan.implementation, plan.exchange) == ("sort", "all_to_all")
    assert _plan("tpu", shape=ep, dropless=True, dispatch="einsum").exchange == "all_to_all"


def test_target_platform_reads_the_mesh_devices():
    assert jax.default_backend() == "cpu"
    assert target_platform(_abstract_mesh("tpu")) == "tpu"
    assert target_platform(_abstract_mesh("gpu")) == "gpu"
    assert target_platform(_abstract_mesh(None)) == "cpu"  # no devices named: the default device
    assert target_platform(None) == "cpu"


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
@pytest.mark.parametrize("dropless", [False, True])
def test_layer_traces_exactly_its_plan(platform, dropless):
    # a (1, 4, 1) mesh: expert parallelism, so the exchange shows in the jaxpr too
    config = replace(SMALL, capacity=replace(SMALL.capacity, dropless=dropless))
    layer = MoeLayer(config, dtype=jnp.bfloat16)
    mesh = _abstract_mesh(platform, (1, 4, 1))
    plan = resolve_plan(layer.config, mesh, layer.dtype)
    found = set(
        re.findall(
            r"\b(ragged_dot\w*|ragged_all_to_all|all_to_all|scan)\b", str(_jaxpr(layer, mesh))
        )
    )
    assert ("ragged_dot_general" in found or "ragged_dot" in found) == (
        plan.implementation == "ragged"
    )
    assert ("ragged_all_to_all" in found) == (plan.exchange == "ragged_all_to_all")
    assert ("all_to_all" in found) == (plan.exchange == "all_to_all")
    assert ("scan" in found) == plan.per_expert_loop
    assert (plan.implementation == "ragged") == (dropless and platform == "tpu")


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
def test_auto_layer_traces_the_platform_choice(platform):
    layer = MoeLayer(SMALL, dtype=jnp.bfloat16)
    plan = resolve_plan(layer.config, _abstract_mesh(platform), layer.dtype)
    auto = _primitives(layer, _abstract_mesh(platform))
    explicit_layer = with_execution(
        layer,
        dispatch=plan.dispatch,
        per_expert_loop=plan.per_expert_loop,
        gather_gradients=plan.gather_gradients,
        scatter_rows=plan.scatter_rows,
    )
    explicit = _primitives(explicit_layer, None)
    assert auto == explicit
    assert ("scan" in auto) == plan.per_expert_loop
    assert ("scatter" in auto) == (plan.dispatch == "sort")
    if platform == "cpu":
        dispatch, loop = "einsum", False
    else:
        cpu = resolve_plan(layer.config, "cpu", layer.dtype)
        dispatch, loop = cpu.dispatch, cpu.per_expert_loop
    other = with_execution(layer, dispatch=dispatch, per_expert_loop=loop)
    assert auto != _primitives(other, None)


def test_layer_compiled_for_a_tpu_topology_takes_the_tpu_choice():
    # the TPU compiler of `make compilers` (make test installs it): never skipped
    devices = np.array(targets.target_devices(targets.parse_target("tpu:v5e:2x2")))
    mesh = jax.sharding.Mesh(devices[:1].reshape(1, 1, 1), AXES)
    layer = MoeLayer(SMALL)
    x = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)
    params = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)  # abstract: no mesh needed
    with jax.set_mesh(mesh):
        hlo = (
            jax.jit(lambda p, x: layer.apply(p, x, mutable=[AUX_LOSS_COLLECTION])[0])
            .lower(params, x)
            .compile()
            .as_text()
        )
    assert jax.default_backend() == "cpu"
    plan = resolve_plan(layer.config, mesh.abstract_mesh, layer.dtype)
    assert plan == ExecutionPlan("tpu", "sort", True, True, "local", scatter_rows=True)
    assert ("while(" in hlo) == plan.per_expert_loop
    assert ("scatter(" in hlo) == (plan.dispatch == "sort")
