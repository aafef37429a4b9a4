"""Gin configs of earlier versions (run directories, exports, sweeps) read in the current
form.

- ``MoeLayer.*`` bindings (the MoE settings before :class:`~moe_jax.moe.config.MoeConfig`):
  :func:`translate` rewrites them as bindings of ``MoeConfig``, the router config of
  ``MoeLayer.router_type`` and the ``CapacityConfig`` / ``ExecutionConfig`` /
  ``AuxLossConfig`` parts (values, macros included, kept as written). Options the run's
  router did not have were ignored by the old layer; they are left out, each with a
  warning, so the translated run computes what it computed.
- Parts left None (:data:`PART_REFERENCES`): the MoE config and its parts were built from
  their own bindings when ``T5Config.moe`` or a ``MoeConfig`` part was None; the gin files
  now bind them (``MoeConfig.capacity = @CapacityConfig()``), so a config that built a
  ``MoeConfig`` gets the references; an earlier one that built none (a model without MoE
  layers) loses its ``T5Config.moe = None``, the default, which the model files now bind
  to a reference.
- Renamed fields (:data:`T5CONFIG_RENAMES`): ``T5Config.dtype`` is
  ``T5Config.activation_dtype_name``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from moe_jax.moe import config as moe_config

# Old MoeLayer field -> (part, field of that part); "router" is the router config.
FIELDS: dict[str, tuple[str, str]] = {
    **{
        name: ("MoeConfig", name)
        for name in (
            "num_experts",
            "d_ff",
            "activation",
            "expert_dropout_rate",
            "expert_granularity",
            "num_shared_experts",
            "shared_expert_d_ff",
            "accept_causal_leak",
        )
    },
    **{
        name: ("router", name)
        for name in (
            "num_selected_experts",
            "num_expert_groups",
            "num_selected_groups",
            "renormalize_gates",
            "jitter_noise",
            "batch_prioritized_routing",
            "bias_update_rate",
            "num_limited_groups",
            "max_groups_per_token",
        )
    },
    "router_init_stddev": ("router", "init_stddev"),
    "router_seed": ("router", "seed"),
    "router_score": ("router", "score_function"),
    **{
        name: ("CapacityConfig", name)
        for name in (
            "train_capacity_factor",
            "eval_capacity_factor",
            "min_expert_capacity",
            "capacity_rule",
            "group_size",
            "dropless",
            "capacity_order",
        )
    },
    **{
        name: ("ExecutionConfig", name)
        for name in ("dispatch", "per_expert_loop", "data_axis", "expert_axis", "model_axis")
    },
    **{
        name: ("AuxLossConfig", name)
        for name in (
            "load_balancing_loss_weight",
            "router_z_loss_weight",
            "importance_loss_weight",
            "load_loss_weight",
            "entropy_loss_weight",
        )
    },
}
# Set by the model, not configuration.
IGNORED = ("causal", "dtype", "name")
# The old MoeLayer's defaults of the router options (what "not set" looked like).
_ROUTER_DEFAULTS = {
    "num_selected_experts": 2,
    "num_expert_groups": 1,
    "num_selected_groups": 1,
    "renormalize_gates": False,
    "jitter_noise": 0.0,
    "batch_prioritized_routing": False,
    "bias_update_rate": 0.0,
    "num_limited_groups": None,
    "max_groups_per_token": 0,
    "init_stddev": 2e-2,
    "seed": 0,
    "score_function": "softmax",
}
_PART_KEYS = {
    "CapacityConfig": "capacity",
    "ExecutionConfig": "execution",
    "AuxLossConfig": "losses",
}
_BINDING = re.compile(r"^MoeLayer\.(\w+)\s*=\s*(.*?)\s*$", re.MULTILINE)
# Earlier names of T5Config fields: {earlier: current} (gin configs and T5Config.from_dict).
T5CONFIG_RENAMES: dict[str, str] = {"dtype": "activation_dtype_name"}
# The fields holding a MoE config or one of its parts, and the reference the gin files bind
# to each (gin/models/t5_moe.gin); a config that binds MoeConfig and leaves one None (or
# unbound) gets it.
PART_REFERENCES: dict[str, str] = {
    "T5Config.moe": "@MoeConfig()",
    "MoeConfig.router": "@TopKRouterConfig()",
    **{f"MoeConfig.{key}": f"@{part}()" for part, key in _PART_KEYS.items()},
}
_BINDS_MOE_CONFIG = re.compile(r"^(\S+/)?MoeConfig\.\w+\s*=", re.MULTILINE)
_RENAMED = re.compile(rf"^(\S+/)?T5Config\.({'|'.join(T5CONFIG_RENAMES)})(?=\s*=)", re.MULTILINE)
_MACRO = re.compile(r"^(\w+)\s*=\s*(.*?)\s*$", re.MULTILINE)


class LegacyOptionError(ValueError):
    """An ``MoeLayer`` option that the configuration cannot express (its router lacks it)."""


def _router_config(router_type: str, where: str) -> type[moe_config.RouterConfig]:
    if router_type not in moe_config.ROUTER_CONFIGS:
        raise LegacyOptionError(
            f"{where}MoeLayer.router_type={router_type!r} is unknown; choose one of "
            f"{tuple(moe_config.ROUTER_CONFIGS)}"
        )
    return moe_config.ROUTER_CONFIGS[router_type]


def split(
    fields: Mapping[str, Any], where: str = ""
) -> tuple[str, dict[str, dict[str, Any]], dict[str, Any]]:
    """(router type, ``{part: {field: value}}``, ``{old name: value}`` of the router options
    its router does not have) of old ``MoeLayer`` ``fields`` (``part``: ``MoeConfig``,
    ``router`` or a part's class name; values as given).

    Raises:
      LegacyOptionError: an unknown field or router type.
    """
    router_cls = _router_config(fields.get("router_type", "top_k"), where)
    router_fields = {f.name for f in dataclasses.fields(router_cls)}
    parts: dict[str, dict[str, Any]] = {"MoeConfig": {}, "router": {}}
    dropped = {}
    for name, value in fields.items():
        if name == "router_type" or name in IGNORED:
            continue
        if name not in FIELDS:
            raise LegacyOptionError(f"{where}MoeLayer.{name} is no option of the MoE layer")
        part, field = FIELDS[name]
        if part == "router" and field not in router_fields:
            dropped[name] = value
            continue
        parts.setdefault(part, {})[field] = value
    return router_cls.router_type, parts, dropped


def config_from_fields(**fields: Any) -> moe_config.MoeConfig:
    """The :class:`MoeConfig` of old ``MoeLayer(**fields)`` keyword arguments (no gin
    bindings read; the types' defaults for what is not given).

    Raises:
      LegacyOptionError: naming an option the router does not have, set to other than the
        old default (the old layer ignored it).
    """
    router_type, parts, dropped = split(fields)
    ignored = [
        name for name, value in dropped.items() if value != _ROUTER_DEFAULTS[FIELDS[name][1]]
    ]
    if ignored:
        raise LegacyOptionError(
            f"MoeLayer.{ignored[0]}: the {router_type!r} router has no such option"
        )
    data = dict(parts["MoeConfig"])
    data["router"] = {"type": router_type, **parts["router"]}
    for part, key in _PART_KEYS.items():
        data[key] = parts.get(part, {})
    return moe_config.from_dict(data)


def legacy_fields(config: moe_config.MoeConfig) -> dict[str, Any]:
    """The old ``MoeLayer`` fields that configure as ``config`` does (router options its
    router does not have at the old defaults): the inverse of :func:`config_from_fields`."""
    parts = {
        "MoeConfig": config,
        "router": config.router,
        **{part: getattr(config, key) for part, key in _PART_KEYS.items()},
    }
    fields = {
        name: getattr(parts[part], field, _ROUTER_DEFAULTS.get(field))
        for name, (part, field) in FIELDS.items()
    }
    return {**fields, "router_type": config.router_type}


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def translate(text: str) -> tuple[str, list[str]]:
    """``text`` (a gin config) in the current form (the module docstring's steps), and one
    warning per ``MoeLayer`` option left out (its router did not have it; the old layer
    ignored it). ``text`` itself, and no warnings, when it is in the current form.

    Raises:
      LegacyOptionError: an unknown ``MoeLayer`` option or router type (names it).
    """
    text, warnings = _translate_moe_layer(text)
    earlier = re.search(_RENAMED, text) is not None
    text = re.sub(_RENAMED, lambda m: f"{m[1] or ''}T5Config.{T5CONFIG_RENAMES[m[2]]}", text)
    if _BINDS_MOE_CONFIG.search(text):
        return _with_part_references(text), warnings
    if earlier:  # a model without MoE layers, written before the model files bound its moe
        text = re.sub(r"^(\S+/)?T5Config\.moe\s*=\s*None\s*\n", "", text, flags=re.M)
    return text, warnings


def _with_part_references(text: str) -> str:
    """``text`` with each field of :data:`PART_REFERENCES` that it leaves None or unbound
    bound to its reference."""
    for name, reference in PART_REFERENCES.items():
        field = re.escape(name)
        text = re.sub(
            rf"^(\S+/)?{field}\s*=\s*None\s*$", rf"\1{name} = {reference}", text, flags=re.M
        )
        if not re.search(rf"^(\S+/)?{field}\s*=", text, flags=re.M):
            text += f"{name} = {reference}\n"
    return text


def binds_moe_layer(text: str) -> bool:
    """Whether ``text`` (a gin config) binds ``MoeLayer.*`` (written before ``MoeConfig``)."""
    return _BINDING.search(text) is not None


def _translate_moe_layer(text: str) -> tuple[str, list[str]]:
    """``text`` with its ``MoeLayer.*`` bindings rewritten in the new form, and the warnings
    of :func:`translate`."""
    bindings = {m.group(1): m.group(2) for m in _BINDING.finditer(text)}
    if not bindings:
        return text, []
    macros = {m.group(1): m.group(2) for m in _MACRO.finditer(text)}

    def value(raw: str) -> Any:
        return _literal(macros.get(raw[1:], raw) if raw.startswith("%") else raw)

    router_type, parts, dropped = split(
        {**bindings, "router_type": value(bindings.get("router_type", "'top_k'"))}, "config.gin: "
    )
    router_cls = moe_config.ROUTER_CONFIGS[router_type]
    warnings = [
        f"MoeLayer.{name} = {raw} had no effect on the {router_type!r} router; left out"
        for name, raw in dropped.items()
        if value(raw) != _ROUTER_DEFAULTS[FIELDS[name][1]]
    ]
    lines = [
        "# MoeLayer.* bindings (the MoE settings before MoeConfig), translated:",
        f"MoeConfig.router = @{router_cls.__name__}()",
    ]
    for part in ("MoeConfig", "router", *_PART_KEYS):
        name = router_cls.__name__ if part == "router" else part
        lines += [f"{name}.{field} = {raw}" for field, raw in sorted(parts.get(part, {}).items())]
    first = min(m.start() for m in _BINDING.finditer(text))
    rest = _BINDING.sub("", text[first:])
    return text[:first] + "\n".join(lines) + "\n" + re.sub(r"\n{3,}", "\n\n", rest), warnings
