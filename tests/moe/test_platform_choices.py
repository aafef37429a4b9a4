"""MoeLayer's hardware-dependent choices (dispatch='auto', per_expert_loop=None) follow the
platform of the mesh's devices, not ``jax.default_backend()`` (CPU in these tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from moe_jax import hardware
from moe_jax.moe import MoeLayer
from moe_jax.moe.dispatch import layer_choices, target_platform
from tests.moe.moe_testlib import SMALL, make_inputs, moe_layer, relayer

AXES = ("data", "expert", "model")


def _abstract_mesh(platform: str | None) -> AbstractMesh:
    device = (
        None
        if platform is None
        else AbstractDevice(device_kind=f"{platform} chip", num_cores=1, platform=platform)
    )
    return AbstractMesh((1, 1, 1), AXES, axis_types=(AxisType.Auto,) * 3, abstract_device=device)


def _primitives(layer: MoeLayer, mesh: AbstractMesh | None) -> set[str]:
    """Top-level primitives of the traced layer (``scan`` = per-expert loop, ``scatter`` =
    the sort dispatch's position scatter; the einsum dispatch has neither)."""
    x = make_inputs()
    params = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)

    def forward(p, x):
        return layer.apply(p, x, mutable=["aux_loss", "moe_metrics"])[0]

    if mesh is None:
        jaxpr = jax.make_jaxpr(forward)(params, x)
    else:
        with jax.sharding.use_abstract_mesh(mesh):
            jaxpr = jax.make_jaxpr(forward)(params, x)
    return {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}


def test_layer_choices_per_platform():
    # sort everywhere (see layer_choices), per-expert loop on CPU, and on TPU for float32
    assert layer_choices("cpu", "bfloat16") == layer_choices("cpu", "float32") == ("sort", True)
    assert layer_choices("tpu", "bfloat16") == ("sort", False)
    assert layer_choices("tpu", jnp.float32) == ("sort", True)
    for gpu in ("gpu", "cuda", "rocm"):
        assert layer_choices(gpu, "bfloat16") == layer_choices(gpu, "float32") == ("sort", False)
    with pytest.raises(ValueError, match="platform"):
        layer_choices("metal", "float32")


def test_target_platform_reads_the_mesh_devices():
    assert jax.default_backend() == "cpu"
    assert target_platform(_abstract_mesh("tpu")) == "tpu"
    assert target_platform(_abstract_mesh("gpu")) == "gpu"
    assert target_platform(_abstract_mesh(None)) == "cpu"  # no devices known: the default backend
    assert target_platform(None) == "cpu"


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
def test_auto_layer_traces_the_platform_choice(platform):
    layer = moe_layer(**SMALL, dtype=jnp.bfloat16)
    dispatch, loop = layer_choices(platform, layer.dtype)
    auto = _primitives(layer, _abstract_mesh(platform))
    explicit = _primitives(relayer(layer, dispatch=dispatch, per_expert_loop=loop), None)
    assert auto == explicit
    assert ("scan" in auto) == loop
    assert ("scatter" in auto) == (dispatch == "sort")
    other = layer_choices("cpu", layer.dtype) if platform != "cpu" else ("einsum", False)
    assert auto != _primitives(relayer(layer, dispatch=other[0], per_expert_loop=other[1]), None)


def test_layer_compiled_for_a_tpu_topology_takes_the_tpu_choice():
    # the TPU compiler of `make compilers` (make test installs it): never skipped
    devices = np.array(hardware.target_devices(hardware.parse_target("tpu:v5e:2x2")))
    mesh = jax.sharding.Mesh(devices[:1].reshape(1, 1, 1), AXES)
    layer = moe_layer(**SMALL)
    x = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)
    params = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)  # abstract: no mesh needed
    with jax.set_mesh(mesh):
        hlo = (
            jax.jit(lambda p, x: layer.apply(p, x, mutable=["aux_loss"])[0])
            .lower(params, x)
            .compile()
            .as_text()
        )
    assert jax.default_backend() == "cpu"
    dispatch, loop = layer_choices("tpu", layer.dtype)
    assert ("while(" in hlo) == loop
    assert ("scatter(" in hlo) == (dispatch == "sort")
