"""One jitted train step (forward, backward, optax Adam update) of the MoE T5 next to its
FLOP-matched dense baseline, on the current backend.

Prints a markdown table: step time, tokens/s (encoder + decoder positions), analytic
training FLOP/s (active experts only, ``EncoderDecoderModel.flops_per_step``) and that
rate as a fraction of a float32 2048x2048 matmul rate measured in the same run.

    python benchmarks/t5_train_step.py                    # d_model 32 and 768, CPU-sized
    python benchmarks/t5_train_step.py --sizes d32 --layers 12 --steps 5
"""

from __future__ import annotations

import argparse
import functools
import time

import flax.linen as nn
import jax
import numpy as np
import optax

from moe_jax.hardware import measured_matmul_flops
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder, T5Config
from moe_jax.moe import CapacityConfig, MoeConfig, TopKRouterConfig

SIZES = {"d32": dict(emb_dim=32, mlp_dim=256), "d768": dict(emb_dim=768, mlp_dim=2048)}


def bench(
    kind: str,
    size: str,
    layers: int,
    sparse: int,
    experts: int,
    batch: int,
    enc_len: int,
    dec_len: int,
    steps: int,
) -> dict:
    common = dict(
        vocab_size=32128,
        num_heads=12,
        head_dim=64,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
        num_sparse_encoder_layers=sparse,
        num_sparse_decoder_layers=sparse,
        **SIZES[size],
    )
    if kind == "moe":
        moe = MoeConfig(
            num_experts=experts,
            d_ff=SIZES[size]["mlp_dim"],
            activation="gated_gelu",
            router=TopKRouterConfig(num_selected_experts=2),
            capacity=CapacityConfig(group_size=4096),
        )
        config = T5Config(sparse_layer_type="moe", moe=moe, **common)
    else:
        config = T5Config(
            sparse_layer_type="dense", flop_matched_mlp_dim=2 * SIZES[size]["mlp_dim"], **common
        )
    model = EncoderDecoderModel(EncoderDecoder(config), z_loss=1e-4)
    shapes = {"encoder_input_tokens": (batch, enc_len), "decoder_input_tokens": (batch, dec_len)}
    params = nn.unbox(model.get_initial_variables(jax.random.key(0), shapes)["params"])
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)
    targets = rng.integers(2, 32000, (batch, dec_len)).astype(np.int32)
    data = {
        "encoder_input_tokens": rng.integers(2, 32000, (batch, enc_len)).astype(np.int32),
        "decoder_target_tokens": targets,
        "decoder_input_tokens": np.concatenate(
            [np.zeros((batch, 1), np.int32), targets[:, :-1]], 1
        ),
        "decoder_loss_weights": np.ones((batch, dec_len), np.float32),
    }

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch, key):
        (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    t = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, data, jax.random.key(1))
    loss.block_until_ready()
    compile_s = time.perf_counter() - t
    times = []
    for i in range(steps):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, data, jax.random.key(2 + i))
        loss.block_until_ready()
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    flops = model.flops_per_step(shapes)
    result = dict(
        kind=kind,
        size=size,
        params=model.num_params(params),
        step_s=step_s,
        compile_s=compile_s,
        tokens_per_s=batch * (enc_len + dec_len) / step_s,
        flops_per_s=flops / step_s,
        flops_per_token=model.flops_per_token(shapes),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="d32,d768")
    parser.add_argument(
        "--layers",
        type=int,
        nargs=2,
        default=(12, 4),
        metavar=("D32", "D768"),
        help="layers per stack for d32 and d768 (the paper: 12; 768 cut for CPU)",
    )
    parser.add_argument("--experts", type=int, nargs=2, default=(32, 8), metavar=("D32", "D768"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--enc_len", type=int, default=128)
    parser.add_argument("--dec_len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    peak = measured_matmul_flops(repeats=10)
    print(
        f"backend {jax.default_backend()}, {jax.device_count()} device(s); "
        f"float32 2048^2 matmul: {peak / 1e9:.1f} GFLOP/s; batch {args.batch}, "
        f"lengths {args.enc_len}/{args.dec_len}, top-2\n"
    )
    print(
        "| model | layers/stack (sparse) | experts | params | step (ms) | compile (s) | tokens/s | "
        "train GFLOP/token | GFLOP/s | of matmul rate |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        idx = 0 if size == "d32" else 1
        layers, experts = args.layers[idx], args.experts[idx]
        sparse = 3 if layers == 12 else 1
        rows = [
            bench(
                kind,
                size,
                layers,
                sparse,
                experts,
                args.batch,
                args.enc_len,
                args.dec_len,
                args.steps,
            )
            for kind in ("moe", "dense")
        ]
        for r in rows:
            name = f"{size} {'MoE' if r['kind'] == 'moe' else 'dense FLOP-matched'}"
            print(
                f"| {name} | {layers} ({sparse}) | {experts if r['kind'] == 'moe' else '-'} | "
                f"{r['params'] / 1e6:.2f}M | {1e3 * r['step_s']:.1f} | {r['compile_s']:.1f} | "
                f"{r['tokens_per_s']:,.0f} | {r['flops_per_token'] / 1e9:.4f} | "
                f"{r['flops_per_s'] / 1e9:.1f} | {100 * r['flops_per_s'] / peak:.1f}% |"
            )
        moe, dense = rows
        print(
            f"| {size} MoE / dense | | | {moe['params'] / dense['params']:.2f}x | "
            f"{moe['step_s'] / dense['step_s']:.2f}x | "
            f"| {moe['tokens_per_s'] / dense['tokens_per_s']:.2f}x | "
            f"{moe['flops_per_token'] / dense['flops_per_token']:.3f}x | | |"
        )


if __name__ == "__main__":
    main()
