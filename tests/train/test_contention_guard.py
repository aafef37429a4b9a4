"""No contended scatter in the train step of any documented run (`moe-jax compile`'s
``contended_scatters``, read from the optimized HLO by ``contention.contended_scatters``).

A scatter adding many updates into few elements is invisible to a roofline estimate and
to XLA:CPU, but its atomic adds serialise on a GPU: the gradient of the relative-position
bias, built as a gather from its ``[12, 32]`` table, was such a scatter (8,192 updates per
element at 512 positions: 94% of a T5-Base step on an H100).
tests/models/test_relative_position.py shows the check naming that gradient's scatter.

The runs are small variants of the documented ones (1+1 layers, both sparse in MoE runs,
a 32k vocabulary, batch 8) at the paper's 512/114 lengths, with the documented heads,
experts, routers and sharding rules: a scatter's updates per written element depend
on those, not on depth or width. Compiled for CPU and a TPU slice here (the GPU target
where its compiler is installed, `make compilers`); the whole matrix is `slow`.
"""

from __future__ import annotations

import pytest

from moe_jax.compile import targets
from tests.train.test_aot import compile_cli

SMALL = [
    "--gin.NUM_ENCODER_LAYERS=1",
    "--gin.NUM_DECODER_LAYERS=1",
    "--gin.NUM_SPARSE_LAYERS=1",
    "--gin.VOCAB_SIZE=32768",
    "--gin.BATCH_SIZE=8",
    "--no_eval",
]
DOCUMENTED = [
    f"{size}_{kind}" for size in ("fig5", "base") for kind in ("learned", "frozen", "dense")
]
TARGETS = {"cpu": "cpu:1", "tpu": "tpu:v5e:2x2", "gpu": "gpu:h100:8"}
QUICK = {("fig5_learned", "cpu"), ("fig5_dense", "cpu"), ("fig5_dense", "tpu")}


def _cases():
    for run in DOCUMENTED:
        for platform in TARGETS:
            marks = [] if (run, platform) in QUICK else [pytest.mark.slow]
            yield pytest.param(run, platform, marks=marks, id=f"{run}-{platform}")


@pytest.mark.parametrize("run,platform", list(_cases()))
def test_no_contended_scatter_in_a_documented_train_step(tmp_path, run, platform):
    if platform == "gpu" and not (targets.compilers_dir() / "gpu").is_dir():
        pytest.skip("no GPU compiler (make compilers)")
    code, output, report = compile_cli(
        tmp_path,
        f"--target={TARGETS[platform]}",
        f"--gin_file=experiments/{run}.gin",
        *SMALL,
        *(["--gin_file=meshes/gpu_8x_h100.gin"] if platform == "gpu" else []),
    )
    assert code == 0, output
    step = report["steps"]["train"]
    assert report["task_feature_lengths"] == {"inputs": 512, "targets": 114}
    contended = step["contended_scatters"]
    assert contended == [], "\n".join(c["text"] for c in contended)
    assert "contended scatters (> 16 updates per element): none" in output
    if platform != "cpu":  # XLA:CPU computes bf16 matmuls in float32: only targets say it
        by_type = step["matmul_flops_by_type"]
        # bfloat16 activations: the attention logits are float32 but their matmuls take
        # bfloat16 (attention.logits_in_float32); the float32 matmuls left are the
        # relative-position biases' contractions of their [12, 32] tables with the one-hot
        # of the [512, 512] and [114, 114] pairs' buckets, forward and backward, and in MoE
        # runs the routers' (float32 router logits), a small share
        bias_flops = 2 * 2 * 12 * 32 * (512**2 + 114**2)
        if run.endswith("dense"):
            assert by_type["f32"] == bias_flops, by_type
        else:
            assert bias_flops < by_type["f32"] < bias_flops + 0.01 * by_type["bf16"], by_type
        assert "matmul FLOPs by operand type: bf16" in output
