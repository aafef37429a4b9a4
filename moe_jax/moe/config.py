"""The MoE layer's configuration: frozen values the model carries, each type a gin name
(registered by :mod:`moe_jax.runtime.configured`; this module reads no gin).

A :class:`MoeConfig` has four named parts besides the experts' shape:

* ``router``: one config type per router (:data:`ROUTER_CONFIGS`), each with only the
  options that router has, so an option of another router cannot be written
  (``NoisyTopKRouterConfig.jitter_noise = 0.5`` is a gin error naming the file and line);
* ``capacity``: :class:`CapacityConfig` (factors, rule, routing groups, dropless, order);
* ``execution``: :class:`ExecutionConfig` (dispatch, per-expert loop, mesh axis names);
* ``losses``: :class:`AuxLossConfig` (weights of the auxiliary losses).

Parts left unset are built from their own gin bindings when the ``MoeConfig`` is built,
so ``CapacityConfig.dropless = True`` alone is enough; a router is chosen with
``MoeConfig.router = @HashRouterConfig()`` (default: :class:`TopKRouterConfig`).
``T5Config.moe`` holds the encoder's config and ``T5Config.decoder_moe`` optionally the
decoder's (gin scope ``decoder/``, as Flaxformer's ``sparse_decoder/``). See docs/moe.md.

Every option is checked here, when its config is built (a bad value is refused naming the
option); the modules that act on the options take them as checked. The named options'
values are the ``typing.Literal`` types of :mod:`moe_jax.moe.options`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn

from moe_jax.moe.hierarchical import HierarchicalRouter, NoisyHierarchicalRouter
from moe_jax.moe.options import (
    ACTIVATIONS,
    BALANCE_SCOPES,
    CAPACITY_ORDERS,
    CAPACITY_RULES,
    DISPATCHES,
    GROUPED_MATMUL_OPTIONS,
    ROUTER_LOSSES,
    SCORE_FUNCTIONS,
    Activation,
    BalanceScope,
    CapacityOrder,
    CapacityOrderOption,
    CapacityRule,
    DispatchOption,
    GroupedMatmulOption,
    RouterLosses,
    RouterType,
    ScoreFunction,
)
from moe_jax.moe.routers import (
    ExpertChoiceRouter,
    HashRouter,
    NoisyTopKRouter,
    RandomRouter,
    TopKRouter,
)
from moe_jax.moe.selection import check_expert_groups

# Router config field -> keyword of its router module where the two names differ.
_MODULE_NAMES = {
    "batch_prioritized_routing": "batch_prioritized",
    "num_expert_groups": "num_groups",
}


def _check_choice(option: str, value: object, choices: tuple[str, ...]) -> None:
    """Refuses ``value`` outside ``choices``, naming ``option`` (``Config.field``)."""
    if value not in choices:
        raise ValueError(f"{option}={value!r} is unknown; choose one of {choices}")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """What every router has: ``num_selected_experts`` (k). Subclasses add their own options.

    :data:`ROUTER_CONFIGS` is the registry of routers: each config names its router and the
    Flax module that routes, and says what kind of router it is (class constants).

    Attributes:
      router_type: the router's name (``MoeConfig.router_type``; ``options.RouterType``).
      module: the Flax router module it configures.
      token_choice: each token picks its experts (``routers.TokenChoiceRouting``); False:
        each expert picks its tokens of the whole routing group (expert choice).
      hierarchical: two-level routing over expert groups (``hierarchical.py``); k is then
        the experts chosen inside each chosen group.
    """

    router_type: ClassVar[RouterType]
    module: ClassVar[type[nn.Module]]
    token_choice: ClassVar[bool] = True
    hierarchical: ClassVar[bool] = False

    num_selected_experts: int = 2

    def __post_init__(self) -> None:
        if self.num_selected_experts < 1:
            raise ValueError(
                f"{type(self).__name__}.num_selected_experts={self.num_selected_experts} "
                "must be >= 1"
            )

    def check_num_experts(self, num_experts: int) -> None:
        """Refuses a k this router cannot choose among ``num_experts`` experts, naming the
        option."""
        k = self.num_selected_experts
        if not 1 <= k <= num_experts:
            raise ValueError(
                f"{type(self).__name__}.num_selected_experts={k} must be between 1 "
                f"and MoeConfig.num_experts={num_experts}"
            )

    def choices_per_token(self, expert_granularity: int) -> int:
        """Assignments per token: ``m * k`` with expert granularity ``m``."""
        return self.num_selected_experts * expert_granularity

    def module_options(self) -> dict[str, Any]:
        """Every option as a keyword of :attr:`module` (``num_selected_experts`` included)."""
        return {
            _MODULE_NAMES.get(f.name, f.name): getattr(self, f.name)
            for f in dataclasses.fields(self)
        }

    def to_dict(self) -> dict[str, Any]:
        """``{"type": router_type, <option>: value...}``."""
        return {"type": self.router_type, **dataclasses.asdict(self)}


def _check_stddev(config: Any) -> None:
    if config.init_stddev <= 0:
        raise ValueError(f"{type(config).__name__}.init_stddev={config.init_stddev} must be > 0")


@dataclasses.dataclass(frozen=True)
class TopKRouterConfig(RouterConfig):
    """Learned token-choice top-k router (T5X / Switch / GShard; DeepSeek-V3 options).

    Attributes:
      renormalize_gates: the k gates divided by their sum.
      jitter_noise: Switch multiplicative router-input noise in training.
      batch_prioritized_routing: BPR: buffer slots by router score (refused in a causal
        decoder unless ``MoeConfig.accept_causal_leak``).
      init_stddev: router kernel init stddev (T5X: 2e-2).
      score_function: ``softmax`` or ``sigmoid`` (DeepSeek-V3; selected gates sum to 1).
      bias_update_rate: u > 0: auxiliary-loss-free balancing bias (selection only),
        updated by ``u * sign(mean load - load_e)`` every training step.
      num_limited_groups, max_groups_per_token: group-limited routing: each token picks
        its experts inside its best M of G expert groups (M = 0: off; G = None: the
        ``expert`` mesh axis size, so a token reaches at most M devices).
      router_bias: a learned bias on the router logits (Switch Transformers'
        ``router_bias``; parameter ``router/weights/b``).
    """

    router_type: ClassVar[RouterType] = "top_k"
    module: ClassVar[type[nn.Module]] = TopKRouter

    renormalize_gates: bool = False
    jitter_noise: float = 0.0
    batch_prioritized_routing: bool = False
    init_stddev: float = 2e-2
    score_function: ScoreFunction = "softmax"
    bias_update_rate: float = 0.0
    num_limited_groups: int | None = None
    max_groups_per_token: int = 0
    router_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_stddev(self)
        if self.jitter_noise < 0:
            raise ValueError(f"TopKRouterConfig.jitter_noise={self.jitter_noise} must be >= 0")
        _check_choice("TopKRouterConfig.score_function", self.score_function, SCORE_FUNCTIONS)
        if self.bias_update_rate < 0 or self.max_groups_per_token < 0:
            raise ValueError(
                "TopKRouterConfig.bias_update_rate and max_groups_per_token must be >= 0"
            )


@dataclasses.dataclass(frozen=True)
class NoisyTopKRouterConfig(RouterConfig):
    """Noisy top-k gating (Shazeer et al., 2017): learned, input-dependent noise in training.

    Attributes:
      batch_prioritized_routing: BPR, as :class:`TopKRouterConfig`'s.
      init_stddev: router kernel init stddev.
    """

    router_type: ClassVar[RouterType] = "noisy_top_k"
    module: ClassVar[type[nn.Module]] = NoisyTopKRouter

    batch_prioritized_routing: bool = False
    init_stddev: float = 2e-2

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_stddev(self)


@dataclasses.dataclass(frozen=True)
class ExpertChoiceRouterConfig(RouterConfig):
    """Expert choice (Zhou et al., 2022): each expert takes its top-C tokens of a group.
    ``num_selected_experts`` is the average experts per token of the ``k_scaled`` capacity
    rule. Reads the whole group: refused in a causal decoder unless
    ``MoeConfig.accept_causal_leak``.

    Attributes:
      init_stddev: router kernel init stddev.
    """

    router_type: ClassVar[RouterType] = "expert_choice"
    module: ClassVar[type[nn.Module]] = ExpertChoiceRouter
    token_choice: ClassVar[bool] = False

    init_stddev: float = 2e-2

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_stddev(self)


@dataclasses.dataclass(frozen=True)
class HashRouterConfig(RouterConfig):
    """Hash routing (Roller et al., 2021): fixed experts per token id; no parameters.

    Attributes:
      seed: seed of the hash.
    """

    router_type: ClassVar[RouterType] = "hash"
    module: ClassVar[type[nn.Module]] = HashRouter

    seed: int = 0


@dataclasses.dataclass(frozen=True)
class RandomRouterConfig(RouterConfig):
    """Random routing: experts drawn per token from a fixed seed; gates from a frozen
    random projection.

    Attributes:
      renormalize_gates: the k gates divided by their sum.
      init_stddev: stddev of the gate projection.
      seed: seed of the draw.
    """

    router_type: ClassVar[RouterType] = "random"
    module: ClassVar[type[nn.Module]] = RandomRouter

    renormalize_gates: bool = False
    init_stddev: float = 2e-2
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_stddev(self)


@dataclasses.dataclass(frozen=True)
class HierarchicalRouterConfig(RouterConfig):
    """Hierarchical MoE (Shazeer et al., 2017, App. B): a primary gate picks
    ``num_selected_groups`` of ``num_expert_groups`` expert groups, a secondary gate in each
    picks its top ``num_selected_experts``; ``k1 * k2`` assignments per token.

    Attributes:
      num_expert_groups: G (E / G experts each; not the routing groups of
        ``CapacityConfig.group_size``).
      num_selected_groups: k1.
      renormalize_gates: each level's gates divided by their sum.
      batch_prioritized_routing: BPR over the assignments.
      init_stddev: gate kernels' init stddev.
    """

    router_type: ClassVar[RouterType] = "hierarchical"
    module: ClassVar[type[nn.Module]] = HierarchicalRouter
    hierarchical: ClassVar[bool] = True

    num_expert_groups: int = 1
    num_selected_groups: int = 1
    renormalize_gates: bool = False
    batch_prioritized_routing: bool = False
    init_stddev: float = 2e-2

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_stddev(self)

    def check_num_experts(self, num_experts: int) -> None:
        """Refuses G not dividing E, ``k1`` outside ``[1, G]`` or ``k2`` outside
        ``[1, E / G]``, naming the option."""
        name = type(self).__name__
        check_expert_groups(
            num_experts,
            self.num_expert_groups,
            self.num_selected_groups,
            f"{name}.num_expert_groups",
            f"{name}.num_selected_groups",
        )
        per_group = num_experts // self.num_expert_groups
        if not 1 <= self.num_selected_experts <= per_group:
            raise ValueError(
                f"{name}.num_selected_experts={self.num_selected_experts} (experts chosen "
                "inside each expert group) must be between 1 and the group size "
                f"num_experts / num_expert_groups = {per_group}"
            )

    def choices_per_token(self, expert_granularity: int) -> int:
        """Assignments per token: ``k1 * k2`` (no granularity: flat routers only)."""
        del expert_granularity
        return self.num_selected_groups * self.num_selected_experts


@dataclasses.dataclass(frozen=True)
class NoisyHierarchicalRouterConfig(HierarchicalRouterConfig):
    """:class:`HierarchicalRouterConfig` with Shazeer's noisy gating at both levels."""

    router_type: ClassVar[RouterType] = "noisy_hierarchical"
    module: ClassVar[type[nn.Module]] = NoisyHierarchicalRouter


# The registry of routers: every router config by its router name (``options.RouterType``).
ROUTER_CONFIGS: dict[str, type[RouterConfig]] = {
    c.router_type: c
    for c in (
        TopKRouterConfig,
        NoisyTopKRouterConfig,
        ExpertChoiceRouterConfig,
        HashRouterConfig,
        RandomRouterConfig,
        HierarchicalRouterConfig,
        NoisyHierarchicalRouterConfig,
    )
}


@dataclasses.dataclass(frozen=True)
class CapacityConfig:
    """How many assignments each expert takes per routing group.

    Attributes:
      train_capacity_factor / eval_capacity_factor: in training / evaluation (T5X: 1.25 / 2.0).
      min_expert_capacity: lower bound on the capacity.
      capacity_rule: ``t5x`` (factor * tokens_per_group / E) or ``k_scaled`` (times k).
      group_size: maximum tokens per routing group.
      dropless: never drop (capacity = tokens_per_group; a grouped matmul with the ``sort``
        dispatch); token-choice routers only.
      capacity_order: ``choice_major`` (T5X: every token's first choice before any second
        choice), ``token_major`` (all choices of token 0, then of token 1, ...) or ``auto``:
        ``token_major`` in a causal decoder, else ``choice_major``.
      expert_capacity: a fixed capacity per expert and routing group instead of the
        factors' (None: the factors'); Hugging Face Switch Transformers' ``expert_capacity``.
      group_by_sequence: each sequence is one routing group (``group_size`` unused), as
        Hugging Face's Switch Transformers fill each expert's capacity per sequence in
        token order.
    """

    train_capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_expert_capacity: int = 4
    capacity_rule: CapacityRule = "t5x"
    group_size: int = 4096
    dropless: bool = False
    capacity_order: CapacityOrderOption = "auto"
    expert_capacity: int | None = None
    group_by_sequence: bool = False

    def __post_init__(self) -> None:
        if self.expert_capacity is not None and self.expert_capacity < 1:
            raise ValueError(f"CapacityConfig.expert_capacity={self.expert_capacity} must be >= 1")
        for name in ("train_capacity_factor", "eval_capacity_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CapacityConfig.{name}={getattr(self, name)} must be > 0")
        _check_choice("CapacityConfig.capacity_rule", self.capacity_rule, CAPACITY_RULES)
        if self.group_size < 1 or self.min_expert_capacity < 0:
            raise ValueError("CapacityConfig.group_size must be >= 1 and min_expert_capacity >= 0")
        _check_choice("CapacityConfig.capacity_order", self.capacity_order, CAPACITY_ORDERS)

    def factor(self, deterministic: bool) -> float:
        """The eval factor when ``deterministic``, else the train factor."""
        return self.eval_capacity_factor if deterministic else self.train_capacity_factor

    def resolved_order(self, causal: bool) -> CapacityOrder:
        """``capacity_order`` with ``auto`` resolved: ``token_major`` when causal."""
        if self.capacity_order != "auto":
            return self.capacity_order
        return "token_major" if causal else "choice_major"


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the expert path runs; the same results either way.

    Attributes:
      dispatch: ``einsum`` (reference), ``sort`` or ``auto`` (per the platform compiled
        for, see ``execution.resolve_plan``).
      per_expert_loop: expert matmuls one expert at a time (``lax.map``); None = per platform.
      grouped_matmul: the dropless path's grouped matmul (``grouped_matmul.py``): ``xla``
        (``jax.lax.ragged_dot``), ``pallas`` (the project's Triton kernel), ``triton``,
        ``mosaic_gpu``, ``mosaic_tpu`` (tokamax kernels) or ``auto`` (``triton`` for a GPU
        step on a GPU where pinned, else ``xla``; never ``pallas``, not yet measured).
      gather_gradients: the ``sort`` / dropless row moves' gradients gather through the
        inverse map instead of scatter-adding (``permute.take_rows``); None = per platform.
      scatter_rows: the ``sort`` / dropless row moves and their gradients scatter rows
        instead of gathering them (``permute.scatter_rows``); None = per platform (TPU,
        unless ``gather_gradients=True``). Not both True.
        The layer runs the ``execution.ExecutionPlan`` that ``resolve_plan`` makes of these.
      data_axis / expert_axis / model_axis: mesh axis names (see expert_parallel.py).
    """

    dispatch: DispatchOption = "auto"
    per_expert_loop: bool | None = None
    grouped_matmul: GroupedMatmulOption = "auto"
    gather_gradients: bool | None = None
    scatter_rows: bool | None = None
    data_axis: str = "data"
    expert_axis: str = "expert"
    model_axis: str = "model"

    def __post_init__(self) -> None:
        _check_choice("ExecutionConfig.dispatch", self.dispatch, DISPATCHES)
        _check_choice("ExecutionConfig.grouped_matmul", self.grouped_matmul, GROUPED_MATMUL_OPTIONS)
        if self.scatter_rows and self.gather_gradients:
            raise ValueError(
                "ExecutionConfig.scatter_rows=True and gather_gradients=True: the row moves "
                "either scatter or gather their gradients; set one"
            )


@dataclasses.dataclass(frozen=True)
class AuxLossConfig:
    """Weights of the auxiliary losses sown into ``collections.AUX_LOSS_COLLECTION``
    (``aux_loss``; 0 = only a metric), and the load-balancing loss' scope.

    Attributes:
      balance_scope: the tokens over which the load-balancing loss measures each expert's
        load and mean probability: ``batch`` (all the tokens of the layer's call at once: the
        global batch of a step; the default), ``group`` (each routing group, the loss
        averaged over groups, as T5X / Flaxformer) or ``sequence`` (each row of the batch,
        averaged over rows: Megatron's ``seq_aux_loss``).
      router_losses: ``per_layer`` (the default): each MoE layer's load-balancing and z-loss
        over its real tokens, summed over layers; ``hf_stack``: Hugging Face Switch
        Transformers' definitions (``losses.hf_stack_losses``), computed once per stack
        over the router logits of all its sparse layers (``balance_scope`` unused), with
        the two weights as ``router_aux_loss_coef`` / ``router_z_loss_coef``. Needs a
        top-1 softmax ``TopKRouterConfig``.
    """

    load_balancing_loss_weight: float = 1e-2
    router_z_loss_weight: float = 1e-4
    importance_loss_weight: float = 0.0
    load_loss_weight: float = 0.0
    entropy_loss_weight: float = 0.0
    balance_scope: BalanceScope = "batch"
    router_losses: RouterLosses = "per_layer"

    def __post_init__(self) -> None:
        _check_choice("AuxLossConfig.balance_scope", self.balance_scope, BALANCE_SCOPES)
        _check_choice("AuxLossConfig.router_losses", self.router_losses, ROUTER_LOSSES)

    def weights(self) -> dict[str, float]:
        """``{loss name: weight}`` (names of ``moe.losses.auxiliary_losses``)."""
        return {
            f.name.removesuffix("_weight"): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name.endswith("_weight")
        }


_PARTS: dict[str, type] = {
    "capacity": CapacityConfig,
    "execution": ExecutionConfig,
    "losses": AuxLossConfig,
}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """One MoE layer's configuration (gin: ``MoeConfig.<field> = ...``).

    Attributes:
      num_experts: E.
      d_ff: hidden size of each expert MLP.
      activation: ``relu``, ``gelu`` or ``gated_gelu`` (T5 v1.1).
      expert_dropout_rate: dropout on the experts' hidden activations in training.
      expert_granularity: m (DeepSeekMoE fine-grained experts): ``m * num_experts`` routed
        experts of ``d_ff / m``, top-``m * k``: same parameters and FLOPs.
      num_shared_experts: always-active experts added to the routed output (DeepSeekMoE).
      shared_expert_d_ff: hidden size of each shared expert (None: the routed experts').
      accept_causal_leak: allow routing that reads later tokens of a group in a causal
        decoder (expert choice, BPR, ``capacity_order='choice_major'`` with k > 1).
      router: a :class:`RouterConfig` (default: a ``TopKRouterConfig`` of its defaults).
      capacity, execution, losses: the named parts (default: their types' defaults). Gin
        files bind each part (``MoeConfig.capacity = @CapacityConfig()``, gin/models/t5_moe.gin).
    """

    num_experts: int = 8
    d_ff: int = 2048
    activation: Activation = "relu"
    expert_dropout_rate: float = 0.0
    expert_granularity: int = 1
    num_shared_experts: int = 0
    shared_expert_d_ff: int | None = None
    accept_causal_leak: bool = False
    # None (the default) is replaced in __post_init__: never None on a built config.
    router: RouterConfig = None  # type: ignore[assignment]
    capacity: CapacityConfig = None  # type: ignore[assignment]
    execution: ExecutionConfig = None  # type: ignore[assignment]
    losses: AuxLossConfig = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        # a part left None gets its type's defaults (no gin binding read: gin files bind the
        # parts, e.g. ``MoeConfig.capacity = @CapacityConfig()``)
        if self.router is None:
            object.__setattr__(self, "router", _build(TopKRouterConfig, {}))
        for name, part in _PARTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, _build(part, {}))
        if not isinstance(self.router, RouterConfig):
            raise ValueError(
                f"MoeConfig.router={self.router!r} is not a router config; use one of "
                f"{', '.join(c.__name__ for c in ROUTER_CONFIGS.values())}"
            )
        for name, part in _PARTS.items():
            if not isinstance(getattr(self, name), part):
                raise ValueError(
                    f"MoeConfig.{name}={getattr(self, name)!r} is not a {part.__name__}"
                )
        self._validate()

    def _validate(self) -> None:
        router = self.router
        if self.num_experts < 1 or self.d_ff < 1:
            raise ValueError(
                f"MoeConfig.num_experts={self.num_experts} and d_ff={self.d_ff} must be >= 1"
            )
        router.check_num_experts(self.num_experts)
        _check_choice("MoeConfig.activation", self.activation, ACTIVATIONS)
        m = self.expert_granularity
        if m < 1 or self.d_ff % m:
            raise ValueError(
                f"MoeConfig.expert_granularity={m} must be >= 1 and divide d_ff={self.d_ff}"
            )
        if m > 1 and router.hierarchical:
            raise ValueError(
                f"MoeConfig.expert_granularity={m} is for flat routers, not {type(router).__name__}"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"MoeConfig.num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.num_shared_experts and not router.token_choice:
            raise ValueError(
                "MoeConfig.num_shared_experts: shared experts are for token-choice routers; "
                f"with {type(router).__name__} experts already take any number of tokens"
            )
        self._check_hf_stack()
        if self.capacity.dropless and not router.token_choice:
            raise ValueError(
                "CapacityConfig.dropless=True needs a token-choice router, "
                f"not {type(router).__name__}"
            )

    def _check_hf_stack(self) -> None:
        """``router_losses='hf_stack'`` is defined for top-1 softmax routing (transformers
        counts each token's argmax expert)."""
        router = self.router
        if self.losses.router_losses == "hf_stack" and not (
            router.router_type == "top_k"
            and getattr(router, "score_function", "softmax") == "softmax"
            and self.choices_per_token == 1
        ):
            raise ValueError(
                "AuxLossConfig.router_losses='hf_stack' is Switch Transformers' top-1 softmax "
                f"routing: it needs TopKRouterConfig(num_selected_experts=1, score_function="
                f"'softmax') and expert_granularity=1, not {router!r} with expert_granularity="
                f"{self.expert_granularity}"
            )

    @property
    def router_type(self) -> RouterType:
        """The router's name (a key of :data:`ROUTER_CONFIGS`)."""
        return self.router.router_type

    @property
    def routed_experts(self) -> int:
        """Routed experts: ``num_experts * expert_granularity``."""
        return self.num_experts * self.expert_granularity

    @property
    def expert_d_ff(self) -> int:
        """Hidden size of one routed expert: ``d_ff / expert_granularity``."""
        return self.d_ff // self.expert_granularity

    @property
    def shared_d_ff(self) -> int:
        """Hidden size of one shared expert."""
        return self.shared_expert_d_ff or self.expert_d_ff

    @property
    def choices_per_token(self) -> int:
        """Assignments per token: ``k`` (``m * k`` with granularity m), or ``k1 * k2`` for
        the hierarchical routers (``RouterConfig.choices_per_token``)."""
        return self.router.choices_per_token(self.expert_granularity)

    def causal_leak(self) -> str | None:
        """Why, in a causal decoder, an earlier token's output would depend on later tokens
        of its group (an option and its effect, for the error message), or None."""
        if not self.router.token_choice:
            return f"{type(self.router).__name__} reads every token of a routing group"
        if getattr(self.router, "batch_prioritized_routing", False):
            return (
                f"{type(self.router).__name__}.batch_prioritized_routing=True ranks the tokens of "
                "a group by their router scores"
            )
        if (
            self.capacity.capacity_order == "choice_major"
            and self.choices_per_token > 1
            and not self.capacity.dropless
        ):
            return (
                "CapacityConfig.capacity_order='choice_major' lets a later token's first choice "
                "take the buffer slot of an earlier token's second choice"
            )
        return None

    def check_causal(self, where: str = "a causal decoder") -> None:
        """Refuses a config that leaks future tokens in ``where`` unless ``accept_causal_leak``.

        Raises:
          ValueError: naming the option.
        """
        leak = self.causal_leak()
        if leak and not self.accept_causal_leak:
            raise ValueError(
                f"{leak}, so in {where} it leaks future tokens; set "
                "MoeConfig.accept_causal_leak=True to accept the leak"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :func:`from_dict` reads it back."""
        nested = ("router", *_PARTS)
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in nested
        }
        out["router"] = self.router.to_dict()
        for name in _PARTS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out


def from_dict(data: Mapping[str, Any]) -> MoeConfig:
    """The :class:`MoeConfig` of :meth:`MoeConfig.to_dict`'s output (no gin bindings read:
    every part is built from the dict, with the types' defaults for missing options).

    Raises:
      ValueError: naming an unknown router type or option.
    """
    data = dict(data)
    router = dict(data.pop("router"))
    kind = router.pop("type")
    if kind not in ROUTER_CONFIGS:
        raise ValueError(f"router type {kind!r} is unknown; choose one of {tuple(ROUTER_CONFIGS)}")
    parts = {name: _build(part, data.pop(name, {})) for name, part in _PARTS.items()}
    return _build(MoeConfig, {**data, "router": _build(ROUTER_CONFIGS[kind], router), **parts})


def default_config() -> MoeConfig:
    """The :class:`MoeConfig` of every default (a ``TopKRouterConfig`` router), no gin
    binding read."""
    return _build(MoeConfig, {})


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls`` with every field passed (``values``, else the field's default), so that no
    gin binding fills one in."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__} has no option {', '.join(unknown)}")
    return cls(**{name: values.get(name, f.default) for name, f in fields.items()})
