"""``EncoderDecoderModel``: the T5X-like wrapper the trainer uses (init, losses, metrics,
decoding, parameter and FLOP accounting) around the Flax :class:`EncoderDecoder`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from moe_jax import param_paths
from moe_jax.models import accounting, decoding, layer_stacking, losses
from moe_jax.models.t5 import EncoderDecoder, T5Config
from moe_jax.moe import losses as moe_losses
from moe_jax.moe.collections import (
    AUX_LOSS_COLLECTION,
    BIAS_COLLECTION,
    MOE_METRICS_COLLECTION,
    ROUTER_STACK_COLLECTION,
)

Batch = Mapping[str, jax.Array]
InputShapes = Mapping[str, tuple[int, ...]]

FEATURES = (
    "encoder_input_tokens",
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
    "encoder_segment_ids",
    "decoder_segment_ids",
    "encoder_positions",
    "decoder_positions",
)
# Non-parameter variable collections that are model state: created by ``init``, carried in
# the train state (``TrainState.collections``), checkpointed, and updated by the training
# forward pass (never by the optimizer). ``router_bias``: the auxiliary-loss-free balancing
# bias of ``TopKRouterConfig.bias_update_rate`` (moe/selection.py).
STATE_COLLECTIONS = (BIAS_COLLECTION,)


# The RNG key the shapes-only methods trace with: a raw ``uint32[2]`` key, as train states use.
RAW_KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)


class InitProgram(NamedTuple):
    """The traced initialisation of a network: ``jaxpr`` (closed; called on a key it gives
    the flat variables) and ``out_tree``, their tree (parameters boxed)."""

    jaxpr: jax_core.ClosedJaxpr
    out_tree: Any


def _collection_by_path(tree: Any) -> dict[tuple[str, ...], jax.Array]:
    """Flattens a sown collection to ``{module path + name: value}`` (sown tuples averaged),
    the layers of scanned runs each under its own path (``encoder/layers_3/...``)."""
    out: dict[tuple[str, ...], list[jax.Array]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(layer_stacking.unstack_layers(tree))[0]:
        names = tuple(param_paths.path_name(path, skip_indices=True).split("/"))
        out.setdefault(names, []).append(jnp.asarray(leaf, jnp.float32))
    return {k: sum(v[1:], v[0]) / len(v) for k, v in out.items()}


def stack_router_losses(config: T5Config, sums: Any) -> dict[str, dict[str, jax.Array]]:
    """``{stack: {loss name: unweighted value}}``: Hugging Face's router losses
    (``losses.hf_stack_losses``) of each stack whose MoE layers sowed their
    ``router_stack`` sums (``AuxLossConfig.router_losses='hf_stack'``); 0, as transformers
    gives, for a stack whose every layer is sparse (its ``sparse_step`` is 1)."""
    by_layer: dict[tuple[str, ...], dict[str, jax.Array]] = {}
    for path, value in _collection_by_path(sums).items():
        by_layer.setdefault(path[:-1], {})[path[-1]] = value
    out = {}
    for stack in ("encoder", "decoder"):
        layers = [value for path, value in by_layer.items() if path[0] == stack]
        depth = config.num_encoder_layers if stack == "encoder" else config.num_decoder_layers
        if not layers:
            continue
        if len(config.sparse_layers(stack)) == depth:
            out[stack] = dict.fromkeys(moe_losses.HF_STACK_LOSSES, jnp.zeros((), jnp.float32))
        else:
            out[stack] = moe_losses.hf_stack_losses(layers)
    return out


def initialising_module(module: nn.Module) -> nn.Module:
    """The network whose ``init`` makes ``module``'s variables: ``module`` when its layers
    are scanned, else its twin with ``scan_layers=True``, whose variables
    :func:`layer_stacking.unstack_layers` turns into ``module``'s tree. A repeated block's
    initialisation is then one program whatever the layer form (T5-Base: 154 random arrays
    instead of 441, compiled about 3x faster), and a seed gives the same parameters to
    both forms."""
    if module.config.scan_layers:
        return module
    return module.clone(config=dataclasses.replace(module.config, scan_layers=True))


@functools.lru_cache(maxsize=32)
def _compiled(jaxpr: jax_core.ClosedJaxpr) -> Any:
    """``jaxpr`` as one jitted function, made once per program (evaluated eagerly, init
    would compile each of its hundreds of operations on its own)."""
    return jax.jit(jax_core.jaxpr_as_fun(jaxpr))


class EncoderDecoderModel:
    """Mirror of T5X's ``EncoderDecoderModel`` for :class:`EncoderDecoder`.

    Args:
      module: the network, an :class:`EncoderDecoder` (gin binds ``@EncoderDecoder()``).
      vocabulary: a seqio vocabulary (``vocab_size``, ``eos_id``), an int vocab size, or a
        function returning one, called on first use (gin: ``@vocab.get_vocabulary`` without
        parentheses), so that building the model opens no vocabulary file.
        Logits for ids the vocabulary does not have (the network's vocab is padded to a
        multiple of 128) are never sampled by :meth:`predict_batch`.
      label_smoothing: in ``[0, 1)``.
      z_loss: weight of ``logsumexp(logits)^2`` (T5X: 1e-4).
      loss_normalizing_factor: ``'NUM_REAL_TARGET_TOKENS'`` (mean over tokens with
        weight), ``'NUM_TOTAL_TARGET_TOKENS'``, a constant, or None (sum).
    """

    def __init__(
        self,
        module: EncoderDecoder,
        vocabulary: Any = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        loss_normalizing_factor: str | float | None = "NUM_REAL_TARGET_TOKENS",
    ) -> None:
        self.module = module
        self._vocabulary = self.module.config.vocab_size if vocabulary is None else vocabulary
        if not callable(self._vocabulary):
            self.check_vocabulary()
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
        if (
            isinstance(loss_normalizing_factor, str)
            and loss_normalizing_factor not in losses.LOSS_NORMALIZERS
        ):
            raise ValueError(
                f"loss_normalizing_factor={loss_normalizing_factor!r}: use a number, "
                f"None or one of {losses.LOSS_NORMALIZERS}"
            )
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.loss_normalizing_factor = loss_normalizing_factor
        self._init_programs: dict[tuple[Any, ...], InitProgram] = {}

    @property
    def vocabulary_source(self) -> Any:
        """The vocabulary as given: a vocabulary, a vocab size, or the function returning
        one (not called here)."""
        return self._vocabulary

    @functools.cached_property
    def vocabulary(self) -> Any:
        """The seqio vocabulary or int vocab size (resolved on first use)."""
        return self._vocabulary() if callable(self._vocabulary) else self._vocabulary

    @property
    def vocab_size(self) -> int:
        return int(
            self.vocabulary if isinstance(self.vocabulary, int) else self.vocabulary.vocab_size
        )

    @property
    def eos_id(self) -> int:
        return 1 if isinstance(self.vocabulary, int) else int(self.vocabulary.eos_id)

    def check_vocabulary(self) -> None:
        """Raises ValueError naming ``VOCAB_SIZE`` when the vocabulary has more ids than the
        network's embedding rows (resolves the vocabulary)."""
        net_vocab = self.module.config.vocab_size
        if self.vocab_size > net_vocab:
            raise ValueError(
                f"vocabulary has {self.vocab_size} ids but T5Config.vocab_size="
                f"{net_vocab}; set VOCAB_SIZE >= {self.vocab_size}"
            )

    # ----------------------------------------------------------------- initialisation
    def get_initial_variables(
        self,
        rng: jax.Array,
        input_shapes: InputShapes,
        input_types: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``{'params': ...}`` with every parameter boxed as ``nn.Partitioned`` (logical names),
        plus the model's non-parameter state collections (``STATE_COLLECTIONS``) it has.

        ``input_shapes`` needs ``encoder_input_tokens`` and ``decoder_input_tokens``
        (``(batch, length)``). The network is traced once per input shapes and key type
        (:meth:`init_program`); every call, under ``jax.jit`` or not, runs that program.
        """
        del input_types
        program = self.init_program(input_shapes, jax.ShapeDtypeStruct(rng.shape, rng.dtype))
        return jax.tree.unflatten(program.out_tree, _compiled(program.jaxpr)(rng))

    def abstract_variables(self, input_shapes: InputShapes) -> dict[str, Any]:
        """:meth:`get_initial_variables`' tree as ``jax.ShapeDtypeStruct`` leaves, boxed
        (nothing allocated, nothing traced after the first call)."""
        program = self.init_program(input_shapes, RAW_KEY)
        leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.jaxpr.out_avals]
        return jax.tree.unflatten(program.out_tree, leaves)

    def param_logical_axes(self, input_shapes: InputShapes) -> Any:
        """Pytree (like params) of ``PartitionSpec`` of logical axis names."""
        return nn.get_partition_spec(self.abstract_variables(input_shapes))["params"]

    def state_logical_axes(self, input_shapes: InputShapes) -> dict[str, Any]:
        """``{collection: PartitionSpec tree}`` of the non-parameter state collections."""
        specs = nn.get_partition_spec(self.abstract_variables(input_shapes))
        return {k: v for k, v in specs.items() if k != "params"}

    def init_program(self, input_shapes: InputShapes, key: jax.ShapeDtypeStruct) -> InitProgram:
        """The network's initialisation for ``input_shapes`` and RNG keys shaped as ``key``,
        traced on the first call and kept on the model: the :func:`initialising_module`'s
        ``init``, its variables in this network's layer form.

        Traced outside any mesh and logical axis rules: its forward pass (whose outputs
        init discards) carries no sharding constraint, so one program serves every mesh."""
        cache_key = (
            tuple(sorted((k, tuple(v)) for k, v in input_shapes.items())),
            tuple(key.shape),
            key.dtype,
        )
        if cache_key not in self._init_programs:
            enc, dec = (input_shapes[k] for k in ("encoder_input_tokens", "decoder_input_tokens"))

            def init(rng: jax.Array) -> dict[str, Any]:
                tokens = jnp.ones(enc, jnp.int32), jnp.ones(dec, jnp.int32)
                module = initialising_module(self.module)
                variables = module.init(
                    {"params": rng, "dropout": rng}, *tokens, tokens[1], enable_dropout=False
                )
                kept = {
                    name: variables[name]
                    for name in ("params", *STATE_COLLECTIONS)
                    if name in variables
                }
                return kept if module is self.module else layer_stacking.unstack_layers(kept)

            no_mesh = jax.sharding.AbstractMesh((), ())
            with jax.sharding.use_abstract_mesh(no_mesh), nn.logical_axis_rules(()):
                jaxpr, out = jax.make_jaxpr(init, return_shape=True)(key)
            self._init_programs[cache_key] = InitProgram(jaxpr, jax.tree.structure(out))
        return self._init_programs[cache_key]

    # ----------------------------------------------------------------- layer layout
    def per_layer(self, tree: Any) -> Any:
        """``tree`` in the one layout outside the model: each layer under its own name
        (``encoder/layers_3/...``). ``tree`` follows this network's module paths in its own
        layout (parameters, optimizer state, variable collections, abstract
        ``ShapeDtypeStruct`` trees with their shardings, subtrees of any of these); a
        scanned block's leaves (``encoder/scan_0/layers_3_7_11/...``, leading axis one
        entry per layer) are split into their layers' entries (device arrays: a copy, laid
        out as the stacked leaf's other axes). An unscanned network's tree is returned
        equal."""
        return layer_stacking.unstack_layers(tree)

    def own_layout(self, tree: Any) -> Any:
        """A per-layer ``tree`` (:meth:`per_layer`'s form) in this network's layout: the
        layers of each scanned block position stacked on a new leading axis (all of a
        position's layers, or none of them, must be there). An unscanned network's tree
        is returned equal.

        Raises:
          ValueError: naming the block position of which only some layers are there.
        """
        return layer_stacking.stack_layers(tree, self._scan_layout)

    @functools.cached_property
    def _scan_layout(self) -> layer_stacking.Layout:
        config = self.module.config
        stacks = ("encoder", "decoder")
        return layer_stacking.runs_layout({s: config.layer_groups(s) for s in stacks})

    # ----------------------------------------------------------------- losses and metrics
    def _forward(
        self,
        params: Any,
        batch: Batch,
        enable_dropout: bool,
        dropout_rng: jax.Array | None,
        state: Mapping[str, Any] | None = None,
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Logits and the collections the pass wrote (sown losses and metrics; in training
        also the updated state collections)."""
        missing = [k for k in FEATURES[:3] if k not in batch]
        if missing:
            raise KeyError(f"batch lacks features {missing}; it has {sorted(batch)}")
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
        state = dict(state or {})
        updated = list(state) if enable_dropout else []
        out = self.module.apply(
            {"params": params, **state},
            *(batch.get(k) for k in FEATURES[:3]),
            *(batch.get(k) for k in FEATURES[4:]),
            enable_dropout=enable_dropout,
            rngs=rngs,
            mutable=[
                AUX_LOSS_COLLECTION,
                MOE_METRICS_COLLECTION,
                ROUTER_STACK_COLLECTION,
                *updated,
            ],
        )
        return cast(tuple[jax.Array, dict[str, Any]], out)  # with mutable: (output, collections)

    def _loss_and_metrics(
        self, logits: jax.Array, state: Mapping[str, Any], batch: Batch
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        targets = batch["decoder_target_tokens"]
        weights = batch.get("decoder_loss_weights")
        weights = (targets > 0) if weights is None else weights
        weights = jnp.asarray(weights, jnp.float32)
        token = losses.cross_entropy_with_logits(logits, targets, self.label_smoothing, self.z_loss)
        token_loss, token_z = token.loss, token.z_term
        total = losses.normalize_loss(
            jnp.sum(token_loss * weights), weights, self.loss_normalizing_factor
        )
        z_term = losses.normalize_loss(
            jnp.sum(token_z * weights), weights, self.loss_normalizing_factor
        )
        metrics: dict[str, jax.Array] = {"cross_entropy": total - z_term, "z_loss": z_term}
        aux_total = jnp.zeros((), jnp.float32)
        for path, loss in _collection_by_path(state.get(AUX_LOSS_COLLECTION, {})).items():
            value = jnp.sum(loss)
            aux_total = aux_total + value
            metrics[path[-1]] = metrics.get(path[-1], 0.0) + value
        config = self.module.config
        stacks = stack_router_losses(config, state.get(ROUTER_STACK_COLLECTION, {}))
        for stack, values in stacks.items():  # AuxLossConfig.router_losses='hf_stack'
            coefficients = config.moe_config(stack).losses.weights()
            for name, value in values.items():
                aux_total = aux_total + coefficients[name] * value
                metrics[name] = metrics.get(name, 0.0) + coefficients[name] * value
                metrics[f"{stack}_{name}"] = value
        for path, value in _collection_by_path(state.get(MOE_METRICS_COLLECTION, {})).items():
            metrics["moe/" + "/".join(p for p in path if p not in ("ffn", "moe"))] = value
        metrics["aux_loss"] = aux_total
        loss = total + aux_total
        metrics["loss"] = loss
        metrics["accuracy"] = losses.token_accuracy(token.predicted, targets, weights)
        metrics["num_tokens"] = jnp.sum(weights)
        return loss, metrics

    def loss_fn(
        self,
        params: Any,
        batch: Batch,
        dropout_rng: jax.Array | None,
        state: Mapping[str, Any] | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Training loss and metrics (differentiable in ``params``); ``state``: the
        non-parameter collections (``STATE_COLLECTIONS``) when the model has any.

        With ``dropout_rng`` set, dropout is on and MoE layers run in training mode
        (train capacity factor); with None both are off (as in T5X).

        Metrics (per step, already normalised): ``loss`` (= ``cross_entropy`` + ``z_loss``
        + ``aux_loss``), ``cross_entropy``, ``z_loss``, ``aux_loss`` and each sown aux loss
        by name summed over layers (with ``AuxLossConfig.router_losses='hf_stack'`` the
        weighted stack losses, and each stack's unweighted ones as
        ``<encoder|decoder>_<loss name>``), ``accuracy`` (weighted token accuracy),
        ``num_tokens`` (sum of loss weights), and every sown MoE metric per layer as
        ``moe/<encoder|decoder>/layers_<i>/<name>`` (``expert_load`` is ``[num_experts]``).
        """
        loss, (metrics, _) = self.train_loss_fn(params, state or {}, batch, dropout_rng)
        return loss, metrics

    def train_loss_fn(
        self, params: Any, state: Mapping[str, Any], batch: Batch, dropout_rng: jax.Array | None
    ) -> tuple[jax.Array, tuple[dict[str, jax.Array], dict]]:
        """:meth:`loss_fn` for the train step: ``(loss, (metrics, new_state))``, where
        ``new_state`` is ``state`` as updated by this forward pass (with ``dropout_rng``;
        unchanged without)."""
        logits, written = self._forward(params, batch, dropout_rng is not None, dropout_rng, state)
        new_state = {name: written.get(name, value) for name, value in state.items()}
        loss, metrics = self._loss_and_metrics(logits, written, batch)
        return loss, (metrics, nn.unbox(new_state))

    def eval_fn(
        self, params: Any, batch: Batch, state: Mapping[str, Any] | None = None
    ) -> dict[str, jax.Array]:
        """Deterministic metrics (eval capacity factor), same names as :meth:`loss_fn`."""
        logits, written = self._forward(params, batch, False, None, state)
        return self._loss_and_metrics(logits, written, batch)[1]

    # ----------------------------------------------------------------- decoding
    def predict_batch(
        self,
        params: Any,
        batch: Batch,
        rng: jax.Array | None = None,
        *,
        decode_method: str = "greedy",
        temperature: float = 1.0,
        max_decode_length: int | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> jax.Array:
        """Generates ``[batch, max_decode_length]`` tokens from ``encoder_input_tokens``.

        ``max_decode_length`` defaults to the length of ``decoder_input_tokens`` (or of
        ``encoder_input_tokens`` if the batch has no decoder features). Jit-friendly.
        """
        enc_tokens = batch["encoder_input_tokens"]
        if max_decode_length is None:
            ref = batch.get("decoder_input_tokens", enc_tokens)
            max_decode_length = ref.shape[1]
        variables = {"params": params, **(state or {})}
        encoded = self.module.apply(
            variables,
            enc_tokens,
            batch.get("encoder_segment_ids"),
            enable_dropout=False,
            method=EncoderDecoder.encode,
        )
        batch_size = enc_tokens.shape[0]
        decode_kwargs: dict[str, Any] = dict(
            enable_dropout=False,
            decode=True,
            max_decode_length=max_decode_length,
            method=EncoderDecoder.decode,
        )
        _, init = self.module.apply(
            variables,
            encoded,
            enc_tokens,
            jnp.ones((batch_size, max_decode_length), jnp.int32),
            mutable=["cache"],
            **decode_kwargs,
        )
        vocab_ok = jnp.arange(self.module.config.vocab_size) < self.vocab_size

        def step(tokens: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
            logits, state = self.module.apply(
                {**variables, "cache": cache},
                encoded,
                enc_tokens,
                tokens,
                mutable=["cache"],
                **decode_kwargs,
            )
            logits = jnp.where(vocab_ok, logits[:, -1].astype(jnp.float32), -1e9)
            return logits, state["cache"]

        return decoding.decode_tokens(
            step,
            init["cache"],
            batch_size,
            max_decode_length,
            self.eos_id,
            rng,
            decode_method=decode_method,
            temperature=temperature,
        )

    # ----------------------------------------------------------------- accounting
    def num_params(self, params: Any) -> int:
        """Total parameter count."""
        return accounting.num_params(params)

    def describe_params(self, params: Any) -> str:
        """The start-up parameter table (path, shape, logical axes, count) and totals."""
        return accounting.describe_params(params)

    def flops_per_example(self, input_shapes: InputShapes, training: bool = True) -> float:
        """Analytic FLOPs of one example (training = 3x forward: forward + backward)."""
        enc_len = input_shapes["encoder_input_tokens"][-1]
        dec_len = input_shapes["decoder_input_tokens"][-1]
        fwd = accounting.forward_flops_per_example(self.module.config, enc_len, dec_len)
        return 3.0 * fwd if training else fwd

    def flops_per_step(self, input_shapes: InputShapes) -> float:
        """Training FLOPs of one step on a batch of ``input_shapes``."""
        return input_shapes["encoder_input_tokens"][0] * self.flops_per_example(input_shapes)

    def flops_per_token(self, input_shapes: InputShapes) -> float:
        """Training FLOPs per token position, counting encoder and decoder positions
        (``flops_per_example / (Le + Ld)``); active experts only."""
        enc_len = input_shapes["encoder_input_tokens"][-1]
        dec_len = input_shapes["decoder_input_tokens"][-1]
        return self.flops_per_example(input_shapes) / (enc_len + dec_len)
