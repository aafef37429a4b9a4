"""``moe_jax.load(RUN_DIR)``: a run's model and parameters in a notebook.

    run = moe_jax.load("runs/switch_base_8")        # a run directory (latest step) or STEP dir
    out = run.forward(inputs, targets)              # int arrays [batch, length], 0 = padding
    out.logits                                      # float32 [batch, target_length, vocab]
    out.experts["encoder/layers_1"]                 # int32 [batch, input_length, k], -1: dropped

Loading parses the run's ``config.gin`` (with ``runs/export.gin``), the model the run's
``run.json``'s when it has one: it replaces the gin config of the process, as every
`moe-jax` command does. The forward pass is
deterministic (no dropout; the evaluation capacity factor) on the devices of the gin
config's mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from moe_jax import storage
from moe_jax.moe.collections import ROUTING_COLLECTION
from moe_jax.runtime import builders, configured, gin_flags, gin_utils, routing, run_config


@dataclasses.dataclass(frozen=True)
class Forward:
    """One forward pass.

    Attributes:
      logits: ``float32 [batch, target_length, vocab]``.
      experts: ``{MoE layer ("encoder/layers_1"): int32 [batch, length, k]}``: the experts
        each token was sent to, best first; -1 where the expert's capacity dropped the
        choice, and on padding unless ``T5Config.padding_semantics`` is ``'hf'`` (an
        imported run's), which routes it. ``length``: the inputs' for encoder layers, the
        targets' for decoder layers.
    """

    logits: np.ndarray
    experts: dict[str, np.ndarray]


@dataclasses.dataclass
class Run:
    """A run's model and the parameters of one checkpoint.

    Attributes:
      path: the checkpoint read (``MODEL_DIR`` or ``MODEL_DIR/STEP``).
      step: its step.
      model: the ``EncoderDecoderModel`` of the run's gin config.
      params: the parameters; ``collections``: the model's state collections.
    """

    path: str
    step: int
    model: Any
    params: Any
    collections: dict[str, Any]

    def forward(self, inputs: Any, targets: Any) -> Forward:
        """The logits and expert choices of ``inputs [batch, Le]`` and ``targets [batch,
        Ld]`` (int, 0 = padding). The decoder reads the targets shifted right (0 first),
        T5X's convention.

        Raises:
          ValueError: naming the argument that is not a 2-D integer array.
        """
        enc, dec = _tokens(inputs, "inputs"), _tokens(targets, "targets")
        if enc.shape[0] != dec.shape[0]:
            raise ValueError(f"inputs has {enc.shape[0]} rows but targets {dec.shape[0]}")
        dec_inputs = np.pad(dec, ((0, 0), (1, 0)))[:, :-1]
        apply = jax.jit(functools.partial(_apply, self.model.module))
        logits, state = apply(self.params, self.collections, enc, dec_inputs, dec)
        experts = {}
        for layer, sown in routing.sown_by_layer(self.model, state).items():
            index, kept = np.asarray(sown["expert_index"]), np.asarray(sown["kept"])
            experts[layer] = np.where(kept, index, -1).astype(np.int32)
        return Forward(np.asarray(logits, np.float32), experts)


def _apply(module, params, collections, enc, dec_inputs, dec) -> tuple[Any, Any]:
    """``(logits, variables)`` of the deterministic forward pass, ``routing`` sown."""
    return module.apply(
        {"params": params, **collections},
        enc,
        dec_inputs,
        dec,
        enable_dropout=False,
        mutable=[ROUTING_COLLECTION],
    )


def _tokens(array: Any, name: str) -> np.ndarray:
    tokens = np.asarray(array)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"{name} must be an int array [batch, length], got {tokens.dtype} {tokens.shape}"
        )
    return tokens.astype(np.int32)


def load(path: str) -> Run:
    """The run at ``path`` (``MODEL_DIR``: its latest checkpoint; ``MODEL_DIR/STEP`` or
    ``MODEL_DIR/checkpoints/STEP``), its model built from its ``run.json`` (else from its
    ``config.gin``).

    Raises:
      moe_jax.errors.UserError: naming the path when it holds no run or checkpoint.
    """
    path = storage.normalize(path)
    args = gin_flags.parse_flags(builders.build_parser("moe_jax.load", "load a run"), [])
    args.gin_file = run_config.run_gin_files(
        args, path, ["runs/export.gin", "runs/load.gin"], command="moe_jax.load"
    )
    gin_utils.parse_gin(args)
    model = configured.model()
    restored = builders.restore_model(
        path,
        model,
        {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 8)},
        configured.run_context(),
    )
    return Run(path, restored.step, model, restored.params, dict(restored.collections or {}))
