"""A run as one typed value: :class:`RunSpec`, what ``MODEL_DIR/run.json`` holds.

    RunSpec
      model       ModelSpec: the network (T5Config with its MoeConfigs), vocabulary, losses
      data        DataSpec: the train and in-training eval datasets, the raw-text source
      loop        LoopSpec: steps, logging, non-finite handling, with its groups
                  CheckpointSettings (T5X's SaveCheckpointConfig) and EvalSettings
      mesh        MeshSpec: mesh shape, logical axis rules, batch axes
      optimizer   OptimizerSpec: the optax optimizer and its ScheduleSpec
      router_mode, bias_mode, seed

Every group is a frozen dataclass; :meth:`RunSpec.to_json` / :meth:`RunSpec.from_json`
round-trip it exactly, and :func:`diff` lists what differs between two specs as dotted
field paths (``optimizer.learning_rate.base_learning_rate``). Gin builds a spec once, at the
command's front door (:mod:`~moe_jax.runtime.configured`, which says which gin name fills
which field); nothing here reads gin. :data:`RESUMABLE` names the fields a resumed run may
change (its length, periods and paths).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import optax

from moe_jax import partitioning
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder, T5Config
from moe_jax.runtime import builders, optimizers


@dataclasses.dataclass(frozen=True)
class VocabularySpec:
    """The arguments of ``vocab.get_vocabulary`` (kind ``embedded``, ``sentencepiece`` or
    ``byte``; the SentencePiece model's path; sentinel ids)."""

    kind: str = "embedded"
    path: str | None = None
    extra_ids: int = 100


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model: ``network`` (every hyperparameter, the MoE configs included),
    ``vocabulary`` (a :class:`VocabularySpec`, or a plain vocabulary size; None: the
    network's ``vocab_size``) and the loss settings of ``EncoderDecoderModel``."""

    network: T5Config
    vocabulary: VocabularySpec | int | None = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    loss_normalizing_factor: str | float | None = "NUM_REAL_TARGET_TOKENS"

    def build(self) -> EncoderDecoderModel:
        """The model this spec describes (its vocabulary opened on first use)."""
        vocabulary: Any = self.vocabulary
        if isinstance(vocabulary, VocabularySpec):
            # deferred on purpose: TensorFlow/seqio load only when data is read
            from moe_jax.data import vocab

            vocabulary = functools.partial(vocab.get_vocabulary, **dataclasses.asdict(vocabulary))
        return EncoderDecoderModel(
            EncoderDecoder(self.network),
            vocabulary=vocabulary,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            loss_normalizing_factor=self.loss_normalizing_factor,
        )


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The training stream, the in-training evaluation's dataset (None: none) and the raw
    text source the project's tasks read (``make_source``'s settings: corpus, TFDS name and
    folder, text patterns)."""

    train: builders.DatasetConfig
    eval: builders.DatasetConfig | None = None
    source: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Saving (T5X's ``SaveCheckpointConfig``): every ``period`` steps and at the end, the
    last ``keep`` kept (None: all), written in the background when ``async_save``."""

    period: int = 1000
    keep: int | None = 3
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """The in-training evaluation: ``steps`` batches of ``data.eval`` every ``period`` steps
    and at the last step (0: never), with the routing churn since the last one when
    ``routing_churn``."""

    period: int = 0
    steps: int = 10
    routing_churn: bool = True


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """The training loop.

    Attributes:
      total_steps: the step the run ends at.
      accum_steps: gradient accumulation microbatches per step.
      log_period: write the train metrics and the throughput every N steps.
      on_nonfinite: ``'stop'`` (naming the step and the last good checkpoint) or ``'skip'``
        (drop that step's update).
      sync_every_step: fetch every step's metrics before dispatching the next (debugging).
      profile_steps: ``(first step, count)`` traced into ``MODEL_DIR/profile``; None: none.
      checkpoint: :class:`CheckpointSettings`.
      eval: :class:`EvalSettings`.
    """

    total_steps: int
    accum_steps: int = 1
    log_period: int = 100
    on_nonfinite: str = "stop"
    sync_every_step: bool = False
    profile_steps: tuple[int, int] | None = None
    checkpoint: CheckpointSettings = CheckpointSettings()
    eval: EvalSettings = EvalSettings()


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """The logical axis rules, the device mesh (``partitioning.make_mesh``'s shape, axis
    names and expert-axis limit) and the mesh axes the batch is split over."""

    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...]
    mesh_shape: tuple[int, ...] = (-1, 1, 1)
    axis_names: tuple[str, ...] = partitioning.MESH_AXES
    max_expert_partitions: int | None = None
    batch_axes: tuple[str, ...] = partitioning.BATCH_AXES

    def context(self, devices: Sequence[Any] | None = None) -> builders.RunContext:
        """The run context over ``devices`` (default: all global devices)."""
        mesh = partitioning.make_mesh(
            self.mesh_shape,
            self.axis_names,
            devices=devices,
            max_expert_partitions=self.max_expert_partitions,
        )
        return builders.RunContext.checked(mesh, self.rules, self.batch_axes)


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """``optimizers.learning_rate_schedule``'s arguments: warmup, then ``decay``."""

    base_learning_rate: float = 1e-2
    warmup_steps: int = 1000
    decay: str = "rsqrt"
    total_steps: int | None = None
    final_learning_rate: float = 0.0


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """``optimizers.create_optimizer``'s arguments; ``learning_rate`` a schedule or a
    constant (None: :class:`ScheduleSpec`'s defaults)."""

    name: str = "adafactor"
    learning_rate: ScheduleSpec | float | None = None
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float | None = None
    momentum: float | None = None

    def build(self) -> tuple[optax.GradientTransformation, optax.Schedule]:
        """The optax optimizer and its learning-rate schedule."""
        rate = ScheduleSpec() if self.learning_rate is None else self.learning_rate
        schedule = (
            optimizers.learning_rate_schedule(**dataclasses.asdict(rate))
            if isinstance(rate, ScheduleSpec)
            else rate
        )
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return optimizers.create_optimizer(**{**options, "learning_rate": schedule})


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run: what it trains, on what, how, where its arrays live (see the
    module docstring); ``router_mode`` (``freeze.ROUTER_MODES``), ``bias_mode``
    (``freeze.BIAS_MODES``) and ``seed`` (parameters, dropout, data order)."""

    model: ModelSpec
    data: DataSpec
    loop: LoopSpec
    mesh: MeshSpec
    optimizer: OptimizerSpec = OptimizerSpec()
    router_mode: str = "learned"
    bias_mode: str = "updated"
    seed: int = 0

    def train_setup(self, model: Any, ctx: builders.RunContext) -> builders.TrainSetup:
        """The state layout and jitted steps of ``model`` (:meth:`ModelSpec.build`'s) on
        ``ctx``'s mesh, for batches of ``data.train``, trained by the optimizer, router
        and bias modes, seed and loop settings of this spec."""
        tx, learning_rate_fn = self.optimizer.build()
        return builders.build_train_setup(
            model,
            self.data.train.input_shapes(),
            ctx,
            tx,
            learning_rate_fn,
            router_mode=self.router_mode,
            bias_mode=self.bias_mode,
            seed=self.seed,
            accum_steps=self.loop.accum_steps,
            skip_nonfinite=self.loop.on_nonfinite == "skip",
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON values (tuples as lists, the network as ``T5Config.to_dict``)."""
        return _encode(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        """The spec of :meth:`to_dict`'s output. Its dataset configs import their task
        ``module`` when built: :func:`model_from_dict` reads the model alone.

        Raises:
          ValueError: naming an unknown or missing field.
        """
        return _decode(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls.from_dict(json.loads(text))


def model_from_dict(data: Mapping[str, Any]) -> ModelSpec:
    """The :class:`ModelSpec` of a recorded spec's dict (:meth:`RunSpec.to_dict`): the
    model alone, nothing imported."""
    return _decode(ModelSpec, data["model"], "model")


# The fields a resumed run may change (fnmatch patterns of dotted paths): its length,
# periods, checkpoint keeping, traced steps and paths.
RESUMABLE: tuple[str, ...] = (
    "loop.total_steps",
    "loop.log_period",
    "loop.profile_steps",
    "loop.checkpoint.*",
    "loop.eval.period",
    "loop.eval.steps",
    "optimizer.learning_rate.total_steps",
    "model.vocabulary.path",
    "data.source.data_dir",
)


def diff(old: RunSpec | Mapping[str, Any], new: RunSpec | Mapping[str, Any]) -> list[tuple]:
    """``(dotted.field.path, old value, new value)`` of every field that differs between two
    specs (or their :meth:`RunSpec.to_dict`), in field order; a field only one has is listed
    with None on the other side."""
    before = old.to_dict() if isinstance(old, RunSpec) else dict(old)
    after = new.to_dict() if isinstance(new, RunSpec) else dict(new)
    flat_before, flat_after = _flatten(before, ""), _flatten(after, "")
    paths = [*flat_before, *(p for p in flat_after if p not in flat_before)]
    return [
        (path, flat_before.get(path), flat_after.get(path))
        for path in paths
        if flat_before.get(path) != flat_after.get(path)
    ]


def resumable(path: str) -> bool:
    """Whether a resumed run may change the field at dotted ``path`` (:data:`RESUMABLE`)."""
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in RESUMABLE)


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    """``{dotted path: leaf}`` of a JSON dict (lists are leaves)."""
    if not isinstance(value, Mapping) or (prefix and not value):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _encode(value: Any) -> Any:
    """``value`` as JSON values: dataclasses as dicts (``to_dict`` where they have one),
    tuples as lists."""
    if isinstance(value, T5Config):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _decode(hint: Any, value: Any, path: str) -> Any:
    """The value of type ``hint`` that :func:`_encode` wrote as ``value`` (at ``path``)."""
    if hint is T5Config:
        return T5Config.from_dict(value)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _decode_dataclass(hint, value, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _decode(_union_arm(args, value), value, path)
    if value is None:
        return None
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, path) for v in value)
        return tuple(_decode(a, v, path) for a, v in zip(args, value, strict=True))
    if origin in (Sequence, list):
        return tuple(_decode(args[0], v, path) for v in value)
    if origin is Mapping or origin is dict:
        return {k: _decode(args[1], v, f"{path}.{k}") for k, v in value.items()}
    return value


def _union_arm(arms: tuple[Any, ...], value: Any) -> Any:
    """The type of ``arms`` a JSON ``value`` was encoded from: None's, a dataclass for a
    dict, a tuple for a list, else the first plain type."""
    if value is None:
        return type(None)
    for arm in arms:
        origin = typing.get_origin(arm)
        if isinstance(value, dict) and dataclasses.is_dataclass(arm):
            return arm
        if isinstance(value, list) and origin in (tuple, Sequence, list):
            return arm
    return next(a for a in arms if not dataclasses.is_dataclass(a) and a is not type(None))


def _default(field: dataclasses.Field) -> Any:
    """The default value of a dataclass field that has one."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _decode_dataclass(cls: type, value: Mapping[str, Any], path: str) -> Any:
    """An instance of the dataclass ``cls`` from its encoded ``value``.

    Raises:
      ValueError: naming a field ``cls`` does not have, or a required one ``value`` lacks.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = path or cls.__name__
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{where}: no field {', '.join(unknown)} in {cls.__name__}")
    hints = typing.get_type_hints(cls)
    missing = [
        name
        for name, f in fields.items()
        if name not in value
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{where}: {cls.__name__} needs {', '.join(missing)}")
    # a field the dict lacks is given its default explicitly: a class gin configures would
    # otherwise read its bindings
    defaults = {name: _default(f) for name, f in fields.items() if name not in value}
    decoded = {
        name: _decode(hints[name], item, f"{path}.{name}" if path else name)
        for name, item in value.items()
    }
    return cls(**defaults, **decoded)
