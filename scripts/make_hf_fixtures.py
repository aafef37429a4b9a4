"""Writes tests/fixtures/hf/: tiny random Hugging Face models and what transformers computes.

Needs the ``parity`` extra (torch and transformers; ``pip install -e '.[parity]'``), which
``make test`` does not: the tests read only the files written here. Each case is a folder
``tests/fixtures/hf/<case>/`` holding what ``save_pretrained`` writes (``config.json``,
``model.safetensors``) and ``expected.npz``:

* ``inputs [batch, Le]``, ``targets [batch, Ld]`` int32 (0 is padding; the decoder reads the
  targets shifted right, pad id 0 first);
* ``logits [batch, Ld, vocab]`` float32, transformers' in eval mode (float32, CPU);
* ``experts/<stack>/<layer>`` ``[batch, length]`` int32: the expert each token went to in a
  Switch model's sparse layer, -1 where the expert's capacity dropped it;
* Switch only, transformers' router losses (``output_router_logits=True``; unweighted):
  ``losses/<name>`` float32 scalars (``encoder_z_loss``, ``encoder_aux_loss``,
  ``decoder_z_loss``, ``decoder_aux_loss``) of that batch, ``router_logits/<stack>/<layer>``
  ``[batch, length, experts]`` float32 the logits they are computed from (padding
  included), and ``full_inputs``, ``full_targets`` (a batch without padding) with
  ``full_losses/<name>``.

    python scripts/make_hf_fixtures.py [--out=tests/fixtures/hf] [--case=NAME ...]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

import numpy as np
import torch
import transformers

VOCAB = 384  # >= the byte vocabulary with 100 sentinels (359), for the analyses
COMMON = {
    "vocab_size": VOCAB,
    "d_model": 16,
    "d_kv": 4,
    "d_ff": 24,
    "num_heads": 2,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "dropout_rate": 0.0,
    "decoder_start_token_id": 0,
}
# case name: (model class, config keywords)
CASES: dict[str, tuple[str, dict]] = {
    # T5 v1.1: gated GELU, untied head, no output scaling
    "t5_v1_1": (
        "T5ForConditionalGeneration",
        {
            "num_layers": 2,
            "num_decoder_layers": 2,
            "feed_forward_proj": "gated-gelu",
            "tie_word_embeddings": False,
        },
    ),
    # the original T5: ReLU, tied head, outputs scaled by d_model ** -0.5
    "t5_relu_tied": (
        "T5ForConditionalGeneration",
        {
            "num_layers": 2,
            "num_decoder_layers": 2,
            "feed_forward_proj": "relu",
            "tie_word_embeddings": True,
        },
    ),
    # Switch, every second layer sparse (1, 3), a router bias, capacity for every token
    "switch_step2": (
        "SwitchTransformersForConditionalGeneration",
        {
            "num_layers": 4,
            "num_decoder_layers": 4,
            "num_sparse_encoder_layers": 2,
            "num_sparse_decoder_layers": 2,
            "num_experts": 4,
            "expert_capacity": 16,
            "router_bias": True,
            "router_jitter_noise": 0.0,
        },
    ),
    # Switch, encoder layer 1 of 3 sparse, every decoder layer sparse; capacity 2 drops tokens
    "switch_step3_drops": (
        "SwitchTransformersForConditionalGeneration",
        {
            "num_layers": 3,
            "num_decoder_layers": 2,
            "num_sparse_encoder_layers": 1,
            "num_sparse_decoder_layers": 2,
            "num_experts": 2,
            "expert_capacity": 2,
            "router_jitter_noise": 0.0,
        },
    ),
}


LOSSES = ("encoder_z_loss", "encoder_aux_loss", "decoder_z_loss", "decoder_aux_loss")


def batch(seed: int, lengths=((10, 6), (7, 4), (4, 2))) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``[3, 10]`` and targets ``[3, 6]`` (ids 2..VOCAB-1, then 1 = EOS), padded
    after each row's lengths."""
    rng = np.random.default_rng(seed)
    inputs, targets = np.zeros((3, 10), np.int32), np.zeros((3, 6), np.int32)
    for row, (n_in, n_out) in enumerate(lengths):
        inputs[row, : n_in - 1] = rng.integers(2, VOCAB, n_in - 1)
        inputs[row, n_in - 1] = 1
        targets[row, : n_out - 1] = rng.integers(2, VOCAB, n_out - 1)
        targets[row, n_out - 1] = 1
    return inputs, targets


def shift_right(targets: np.ndarray) -> np.ndarray:
    """T5X's decoder inputs: 0 first, the targets without their last token."""
    return np.pad(targets, ((0, 0), (1, 0)))[:, :-1]


def run(model, inputs: np.ndarray, targets: np.ndarray, switch: bool):
    """transformers' eval-mode outputs (router losses and logits with ``switch``)."""
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(inputs, dtype=torch.long),
            attention_mask=torch.tensor(inputs > 0, dtype=torch.long),
            decoder_input_ids=torch.tensor(shift_right(targets), dtype=torch.long),
            **({"output_router_logits": True} if switch else {}),
        )


def router_losses(output, prefix: str) -> dict[str, np.ndarray]:
    """``{prefix/<name>: float32 scalar}`` of transformers' four router losses (0 where
    it skips a stack)."""
    return {f"{prefix}/{k}": np.float32(float(getattr(output, k))) for k in LOSSES}


def make_case(name: str, model_class: str, keywords: dict, out: pathlib.Path, seed: int) -> None:
    torch.manual_seed(seed)
    config_class = getattr(transformers, model_class.replace("ForConditionalGeneration", "Config"))
    model = getattr(transformers, model_class)(config_class(**COMMON, **keywords)).eval()
    with torch.no_grad():  # visible, non-trivial norms and relative-position biases
        for param_name, param in model.named_parameters():
            if param_name.endswith("layer_norm.weight") or "relative_attention_bias" in param_name:
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            if param_name.endswith("classifier.bias"):
                param.copy_(0.5 * torch.randn_like(param))
    chosen: dict[str, np.ndarray] = {}
    logits: dict[str, np.ndarray] = {}

    def record(module_name: str):
        def hook(module, args, output):
            one_hot = output[0].numpy()  # [batch, length, experts], 0 where dropped
            chosen[module_name] = np.where(one_hot.any(-1), one_hot.argmax(-1), -1)
            logits[module_name.replace("experts/", "router_logits/")] = output[2].numpy()

        return hook

    for module_name, module in model.named_modules():
        if module_name.endswith("mlp.router"):
            stack, _, layer = module_name.split(".")[:3]
            module.register_forward_hook(record(f"experts/{stack}/{layer}"))
    switch = model_class.startswith("Switch")
    inputs, targets = batch(seed)
    output = run(model, inputs, targets, switch)
    experts = dict(chosen)  # this batch's, before the next run's hooks
    extra = {}
    if switch:
        extra = {**router_losses(output, "losses"), **logits}
        full_inputs, full_targets = batch(seed + 100, ((10, 6),) * 3)
        full = router_losses(run(model, full_inputs, full_targets, True), "full_losses")
        extra.update(full_inputs=full_inputs, full_targets=full_targets, **full)
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    for leftover in {p.name for p in folder.iterdir()} - {"config.json", "model.safetensors"}:
        (folder / leftover).unlink()  # generation_config.json: not read
    np.savez_compressed(
        folder / "expected.npz",
        inputs=inputs,
        targets=targets,
        logits=output.logits.numpy().astype(np.float32),
        **{k: v.astype(np.int32) for k, v in experts.items()},
        **extra,
    )
    print(f"{folder}: {sum(p.stat().st_size for p in folder.iterdir()):,} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("tests/fixtures/hf"))
    parser.add_argument(
        "--case", action="append", choices=tuple(CASES), help="only these (default: all)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for seed, (name, (model_class, keywords)) in enumerate(CASES.items()):
        if args.case is None or name in args.case:  # each case keeps its seed
            make_case(name, model_class, keywords, args.out, seed)


if __name__ == "__main__":
    main()
