"""The project's flash-attention kernel (``moe_jax.models.flash_attention``) computes what
the XLA path computes: outputs and the gradients of q, k, v and the batch-shared bias,
through Pallas's interpreter on CPU, for padding, causal, cross and packed masks and
lengths that are not a multiple of the tile; the T5 model gives the same loss and
gradients with either kernel; compiled for an H100 its attention is Triton kernels, no
``[batch, heads, q_len, k_len]`` array is left in the program, and the compiled program's
reader counts the kernels' FLOPs."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import partitioning
from moe_jax.compile import targets
from moe_jax.models.attention import (
    AttentionMask,
    MultiHeadDotProductAttention,
    check_kernel_platform,
    dot_product_attention,
)
from moe_jax.models.flash_attention import KERNEL_MATMULS, flash_attention
from moe_jax.models.t5 import EncoderDecoder

from .conftest import random_batch, tiny_config

BLOCK = 8  # tiles of 8 rows: the lengths below are not multiples of it


def _qkv(batch, q_len, k_len, heads=2, head_dim=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, k_len, heads, head_dim))
    v = jax.random.normal(keys[2], (batch, k_len, heads, head_dim))
    bias = 2.0 * jax.random.normal(keys[3], (1, heads, q_len, k_len))
    return q, k, v, bias


def _check_against_xla(mask: AttentionMask, q, k, v, bias, atol=2e-5):
    """Outputs on real query rows and all four gradients equal the XLA path's (padding
    rows are never read: their weight in the loss is 0)."""
    real = np.asarray(jnp.any(mask.dense[:, 0], axis=-1))  # [batch, q_len]
    weights = jnp.asarray(real, jnp.float32)[:, :, None, None]

    def reference(q, k, v, bias):
        return dot_product_attention(q, k, v, bias=bias, mask=mask.dense)

    def flash(q, k, v, bias):
        return flash_attention(
            q,
            k,
            v,
            bias,
            mask.query_segments,
            mask.key_segments,
            causal=mask.causal,
            block_q=BLOCK,
            block_k=BLOCK,
            interpret=True,
        )

    def loss(fn, *args):
        return jnp.sum(jnp.sin(fn(*args)) * weights)

    np.testing.assert_allclose(
        flash(q, k, v, bias)[real], reference(q, k, v, bias)[real], atol=atol
    )
    argnums = (1, 2, 3) if bias is None else (1, 2, 3, 4)
    grads = jax.grad(loss, argnums=argnums)
    for got, want in zip(grads(flash, q, k, v, bias), grads(reference, q, k, v, bias), strict=True):
        assert got.shape == want.shape  # the bias gradient stays [1, heads, q, k]
        np.testing.assert_allclose(got, want, atol=atol)


def test_padded_self_attention_with_bias_matches_xla():
    q, k, v, bias = _qkv(2, 13, 13)
    valid = jnp.arange(13)[None] < jnp.array([[9], [13]])
    _check_against_xla(AttentionMask.from_padding(valid, valid), q, k, v, bias)


def test_causal_self_attention_matches_xla():
    """Causality as a flag: tiles above the diagonal are skipped, the diagonal masked."""
    q, k, v, bias = _qkv(2, 19, 19, seed=1)
    valid = jnp.arange(19)[None] < jnp.array([[19], [11]])
    _check_against_xla(AttentionMask.from_padding(valid, valid, causal=True), q, k, v, bias)


def test_cross_attention_of_other_lengths_without_bias_matches_xla():
    q, k, v, _ = _qkv(2, 6, 21, seed=2)
    q_valid = jnp.arange(6)[None] < jnp.array([[4], [6]])
    k_valid = jnp.arange(21)[None] < jnp.array([[21], [5]])
    _check_against_xla(AttentionMask.from_padding(q_valid, k_valid), q, k, v, None)


def test_packed_segments_are_kept_apart():
    """Two and three segments per row (seqio's ids), one row ending in padding: the
    kernel's ``q_seg == k_seg != 0`` rule is the dense mask."""
    q, k, v, bias = _qkv(2, 12, 12, seed=3)
    segments = jnp.array(
        [[1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0], [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3]]
    )
    valid = segments > 0
    mask = AttentionMask.from_padding(valid, valid, causal=True, segments=(segments, segments))
    assert mask.query_lengths is None  # packed: only the dense form and the ids
    _check_against_xla(mask, q, k, v, bias)


def test_the_kernel_is_refused_for_a_tpu_by_name_and_allowed_elsewhere():
    with pytest.raises(ValueError, match=r"attention_kernel='pallas'.*TPU.*'xla'"):
        check_kernel_platform("pallas", "tpu")
    for platform in ("cpu", "gpu", "cuda"):
        check_kernel_platform("pallas", platform)
    check_kernel_platform("xla", "tpu")


def test_a_bias_per_example_is_refused_by_name():
    q, k, v, _ = _qkv(2, 8, 8)
    ids = jnp.ones((2, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"\[1, heads, q_len, k_len\]"):
        flash_attention(q, k, v, jnp.zeros((2, 2, 8, 8)), ids, ids, interpret=True)


@pytest.mark.parametrize("packed", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_model_computes_the_same_loss_and_gradients_with_either_kernel(packed):
    """A tiny T5 (2 + 2 layers: encoder self, decoder causal self and cross attention)
    with ``attention_kernel='pallas'`` against ``'xla'``: loss and every parameter's
    gradient (the shared relative-position biases included) agree, padded or packed."""
    batch = random_batch(seed=4, enc_len=10, dec_len=7)
    del batch["decoder_loss_weights"]
    batch["encoder_input_tokens"][0, 8:] = 0  # padding at the end of row 0
    batch["decoder_target_tokens"][1, 5:] = 0
    if packed:
        batch["encoder_segment_ids"] = np.array([[1] * 6 + [2] * 4, [1] * 10], np.int32)
        batch["decoder_segment_ids"] = np.array([[1] * 4 + [2] * 3, [1] * 7], np.int32)
    models = {
        kernel: EncoderDecoder(tiny_config(attention_kernel=kernel)) for kernel in ("xla", "pallas")
    }
    params = models["xla"].init(jax.random.key(0), **batch, enable_dropout=False)["params"]

    def loss(params, kernel):
        logits = models[kernel].apply({"params": params}, **batch, enable_dropout=False)
        weights = jnp.asarray(batch["decoder_target_tokens"] > 0, jnp.float32)
        return jnp.sum(jnp.square(logits) * weights[..., None])

    (loss_xla, grads_xla), (loss_pallas, grads_pallas) = (
        jax.value_and_grad(loss)(params, kernel) for kernel in ("xla", "pallas")
    )
    np.testing.assert_allclose(loss_pallas, loss_xla, rtol=1e-5)
    flat_xla = jax.tree_util.tree_leaves_with_path(grads_xla)
    flat_pallas = jax.tree.leaves(grads_pallas)
    for (path, want), got in zip(flat_xla, flat_pallas, strict=True):
        np.testing.assert_allclose(
            got, want, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want))), err_msg=str(path)
        )


def test_under_a_mesh_each_device_attends_its_share_and_the_bias_gradient_is_summed():
    """On a (data 4, expert 1, model 2) mesh of CPU devices with the standard rules, the
    kernel runs in ``shard_map`` (batch over data, heads over model): the attention
    module's output and the gradients of its weights and of the shared bias equal the XLA
    path's, unsharded."""
    devices = np.array(jax.devices()[:8]).reshape(4, 1, 2)
    mesh = jax.sharding.Mesh(devices, partitioning.MESH_AXES)
    x = jax.random.normal(jax.random.key(5), (4, 12, 32))
    bias = jax.random.normal(jax.random.key(6), (1, 4, 12, 12))
    valid = jnp.arange(12)[None] < jnp.array([[12], [7], [9], [3]])
    mask = AttentionMask.from_padding(valid, valid, causal=True)
    weights = jnp.asarray(valid, jnp.float32)[:, :, None]

    def loss(kernel, params, bias):
        layer = MultiHeadDotProductAttention(num_heads=4, head_dim=8, kernel=kernel)
        out = layer.apply({"params": params}, x, x, mask, bias, deterministic=True)
        return jnp.sum(jnp.sin(out) * weights)

    layer = MultiHeadDotProductAttention(num_heads=4, head_dim=8)
    params = layer.init(jax.random.key(7), x, x, mask, bias, deterministic=True)["params"]
    want = jax.value_and_grad(functools.partial(loss, "xla"), argnums=(0, 1))(params, bias)
    with partitioning.activate(mesh, partitioning.standard_logical_axis_rules()):
        step = jax.jit(jax.value_and_grad(functools.partial(loss, "pallas"), argnums=(0, 1)))
        assert "sdy.manual_computation" in step.lower(params, bias).as_text()  # shard_map
        got = step(params, bias)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)


H100_CHILD = """
import json, re
from moe_jax.compile import targets
devices = targets.target_devices(targets.parse_target("gpu:h100:1"))
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from moe_jax.compile import hlo_costs
from moe_jax.models.t5 import EncoderDecoder, T5Config
s = SingleDeviceSharding(devices[0])
shapes = dict(encoder_input_tokens=(8, 128), decoder_input_tokens=(8, 64),
              decoder_target_tokens=(8, 64))
batch = {k: jax.ShapeDtypeStruct(v, jnp.int32, sharding=s) for k, v in shapes.items()}
scores = [f"[8,4,{q},{k}]" for q, k in ((128, 128), (64, 64), (64, 128))]
found = {}
for kernel in ("xla", "pallas"):
    model = EncoderDecoder(T5Config(
        vocab_size=128, emb_dim=64, num_heads=4, head_dim=16, mlp_dim=128,
        num_encoder_layers=2, num_decoder_layers=2, activation_dtype_name="bfloat16",
        attention_kernel=kernel))
    abstract = jax.eval_shape(
        lambda b: model.init(jax.random.key(0), **b, enable_dropout=False),
        {k: jnp.zeros(v, jnp.int32) for k, v in shapes.items()})
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract)
    def step(params, batch):
        def loss(p):
            logits = model.apply(p, **batch, enable_dropout=False)
            return jnp.mean(logits.astype(jnp.float32) ** 2)
        return jax.grad(loss)(params)
    text = jax.jit(step).lower(params, batch).compile().as_text()
    found[kernel] = {
        "triton_calls": text.count('custom_call_target="__gpu$xla.gpu.triton"'),
        "score_arrays": sum(text.count(s) for s in scores),
        "kernel_flops": sum(
            op.flops for op in hlo_costs.parse(text) if "t5_flash_attention" in op.source
        ),
    }
print(json.dumps(found))
"""


@pytest.mark.skipif(
    not (targets.compilers_dir() / "gpu").is_dir(), reason="no GPU compiler (make compilers)"
)
def test_compiled_for_an_h100_attention_is_triton_kernels_without_score_arrays(tmp_path):
    """A tiny bfloat16 T5's gradient compiled for one H100 (in a fresh process): with
    ``'pallas'`` each self-attention is 4 Triton kernels (forward, dK/dV, dQ, the bias
    gradient), each cross attention 3 (no bias), and no ``[batch, heads, q, k]`` array is
    left; with ``'xla'`` the scores are there and no Triton kernel is."""
    import subprocess
    import sys

    child = tmp_path / "child.py"
    child.write_text(H100_CHILD)
    run = subprocess.run(
        [sys.executable, str(child)], capture_output=True, text=True, timeout=600, check=True
    )
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["xla"]["triton_calls"] == 0 and found["xla"]["score_arrays"] > 0
    assert found["pallas"]["score_arrays"] == 0
    assert found["pallas"]["triton_calls"] == 4 * 4 + 3 * 2
    # the roofline's FLOPs of the kernels: their matmuls per (batch, head), 2 * 8 * 4 * 16
    # per [q, k] element (batch 8, 4 heads of 16), the cross attention without dbias
    per_pair = 2 * 8 * 4 * 16 * sum(KERNEL_MATMULS.values())
    cross = (
        2 * 8 * 4 * 16 * (sum(KERNEL_MATMULS.values()) - KERNEL_MATMULS["t5_flash_attention_dbias"])
    )
    want = 2 * (per_pair * 128 * 128 + per_pair * 64 * 64 + cross * 64 * 128)
    assert found["pallas"]["kernel_flops"] == want and found["xla"]["kernel_flops"] == 0
