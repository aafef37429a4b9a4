"""``Model``: what the runtime and the commands call on a model (T5X's ``BaseModel`` role),
as a typing Protocol; ``models.model.EncoderDecoderModel`` is the project's.

Arrays: ``batch`` maps feature names to ``int32[batch, length]`` arrays; ``input_shapes``
maps ``encoder_input_tokens`` / ``decoder_input_tokens`` to ``(batch, length)``; ``params``
and ``state`` are the parameter tree and the ``{collection: tree}`` of non-parameter state
collections (e.g. ``router_bias``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax

from moe_jax.models.model import Batch, InputShapes
from moe_jax.models.t5 import EncoderDecoder

Metrics = dict[str, jax.Array]


class Model(Protocol):
    """A trainable encoder-decoder: its variables and their logical axes, losses, metrics,
    decoding, and its parameter and FLOP accounting."""

    @property
    def module(self) -> EncoderDecoder:
        """The Flax network (``module.config``: its ``T5Config``)."""
        ...

    @property
    def vocabulary(self) -> Any:
        """The seqio vocabulary, or an int vocab size."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def check_vocabulary(self) -> None:
        """Raises ValueError when the vocabulary has more ids than the network's embedding."""
        ...

    def get_initial_variables(
        self, rng: jax.Array, input_shapes: InputShapes, input_types: Any = None
    ) -> dict[str, Any]:
        """``{"params": tree, <state collection>: tree}``, leaves boxed with logical names."""
        ...

    def abstract_variables(self, input_shapes: InputShapes) -> dict[str, Any]:
        """:meth:`get_initial_variables` as boxed ``jax.ShapeDtypeStruct`` leaves."""
        ...

    def param_logical_axes(self, input_shapes: InputShapes) -> Any:
        """The parameter tree of logical ``PartitionSpec`` s."""
        ...

    def state_logical_axes(self, input_shapes: InputShapes) -> dict[str, Any]:
        """``{collection: tree of logical PartitionSpec}`` of the state collections."""
        ...

    def per_layer(self, tree: Any) -> Any:
        """``tree`` (any tree following the network's module paths, in its own layout)
        with every layer under its own name ``<stack>/layers_<i>``: the one layout that
        checkpoints, exports, analyses and upcycling see."""
        ...

    def own_layout(self, tree: Any) -> Any:
        """A :meth:`per_layer` tree in the network's own layout (scanned blocks stacked)."""
        ...

    def train_loss_fn(
        self, params: Any, state: Mapping[str, Any], batch: Batch, dropout_rng: jax.Array | None
    ) -> tuple[jax.Array, tuple[Metrics, dict]]:
        """``(loss, (metrics, new_state))`` of a training forward pass."""
        ...

    def eval_fn(self, params: Any, batch: Batch, state: Mapping[str, Any] | None = None) -> Metrics:
        """Deterministic metrics of a batch (eval capacity factor)."""
        ...

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
        """``[batch, max_decode_length]`` generated tokens."""
        ...

    def num_params(self, params: Any) -> int: ...

    def flops_per_step(self, input_shapes: InputShapes) -> float:
        """Training FLOPs of one step on a batch of ``input_shapes``."""
        ...
