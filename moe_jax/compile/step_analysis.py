"""What one compiled step needs and costs per device: its memory against the device's
(:func:`memory_fit`), and from its cost analysis and HLO text (:func:`analyze`,
:func:`hlo_analysis`) the collectives by kind (count, and bytes moved as
:mod:`moe_jax.compile.collectives` defines them), the MoE layers' share, the contended
scatters (:mod:`moe_jax.compile.contention`), FLOPs and bytes per step and a roofline
estimate of step time and tokens/s. What a compiler does not report is left as None
(unknown), never zero: GPU executables compiled without a GPU have no cost analysis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_jax import hardware
from moe_jax.compile import collectives, contention, hlo_costs

MOE_SOURCE = "/ffn/moe/"  # JAX source path of the ops of a T5 block's MoE layer (models/t5.py)
# What the HBM term counts where the compiler has no cost analysis: ``hlo_costs.summary``.
HLO_TEXT = "HLO text"


def memory_fit(compiled: Any, facts: hardware.DeviceFacts, state_bytes: int) -> dict[str, Any]:
    """``bytes`` (the compiled step's memory per device by kind, from its
    ``memory_analysis``) and whether it ``fits`` the device's memory: all a run needs to know
    before it starts, without reading the HLO text."""
    mem = compiled.memory_analysis()
    total = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    return {
        "bytes": {
            "params_and_optimizer": state_bytes,
            "arguments": mem.argument_size_in_bytes,
            "outputs": mem.output_size_in_bytes,
            "aliased": mem.alias_size_in_bytes,
            "temporaries": mem.temp_size_in_bytes,
            "total": total,
            "device_memory": facts.hbm_bytes,
        },
        "fits": total <= facts.hbm_bytes,
    }


def analyze(
    compiled: Any,
    facts: hardware.DeviceFacts,
    *,
    state_bytes: int,
    flops_per_step: float,
    tokens_per_step: int,
    num_devices: int,
) -> dict[str, Any]:
    """Memory (:func:`memory_fit`), collectives, cost and a roofline step time of one
    compiled step (per device)."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    return {
        **memory_fit(compiled, facts, state_bytes),
        "flops_per_step": flops_per_step,
        "hlo_flops_per_device": cost.get("flops"),
        "hlo_bytes_accessed_per_device": cost.get("bytes accessed"),
        **hlo_analysis(
            compiled.as_text(),
            facts,
            flops_per_step=flops_per_step,
            bytes_accessed=cost.get("bytes accessed"),
            tokens_per_step=tokens_per_step,
            num_devices=num_devices,
        ),
    }


def hlo_analysis(
    hlo_text: str,
    facts: hardware.DeviceFacts,
    *,
    flops_per_step: float,
    bytes_accessed: float | None,
    tokens_per_step: int,
    num_devices: int,
) -> dict[str, Any]:
    """What the compiled HLO text gives (read once by ``hlo_costs.parse``): its
    ``collectives`` by kind (``collectives.collective_totals``: count and bytes moved per
    device, as defined there), the ``moe_layers``' share, the ``contended_scatters``
    (``contention.contended_scatters``: scatters adding more than
    ``contention.CONTENTION_LIMIT`` updates per element they write, which the roofline cannot
    see: on a GPU such a scatter's atomic adds serialise), ``per_step``: the step's matmul
    ``flops``, device-memory ``bytes`` and TPU estimated ``cycles`` from the HLO text with
    every loop body counted once per trip (``hlo_costs.summary``; ``looped``: whether any
    work runs in a loop, where XLA's cost analysis, counting a body once, falls short;
    ``bytes_by_part``: the bytes by part of the model, ``hlo_costs.bytes_by_part``), the
    ``matmul_flops_by_type``
    (``hlo_costs.matmul_flops_by_type``: float32 matmuls in a bfloat16 step run slower than
    the estimate's bf16 peak) and the roofline ``estimate`` ``max(FLOPs / peak, bytes
    accessed / HBM bandwidth) + collective bytes / interconnect bandwidth``, with the
    model's FLOPs split evenly over the devices (XLA's cost analysis counts a loop body
    once) and the chip's bf16 peak.

    The HBM term charges ``bytes_accessed``, XLA's cost analysis; where the compiler gives
    none (GPU executables compiled without a GPU) the HLO text's bytes per step
    (``per_step.bytes``) instead, and ``covers`` says so (``'HBM (HLO text)'``). A chip
    without an HBM bandwidth (CPU): ``hbm_s`` is None and the estimate covers compute and
    collectives only (``covers`` says which terms it holds; ``step_s`` and
    ``tokens_per_s`` are then bounds)."""
    ops = hlo_costs.parse(hlo_text)
    coll = collectives.collective_totals(ops)
    totals = hlo_costs.summary(ops)
    compute_s = flops_per_step / num_devices / facts.peak_flops
    hbm_bytes = totals["bytes"] if bytes_accessed is None else bytes_accessed
    hbm_s = hbm_bytes / facts.hbm_bandwidth if facts.hbm_bandwidth else None
    comm_s = (
        sum(c["bytes"] for c in coll.values()) / facts.interconnect_bandwidth
        if facts.interconnect_bandwidth
        else None
    )
    step_s = max(compute_s, hbm_s or 0.0) + (comm_s or 0.0)
    hbm = "HBM" if bytes_accessed is not None else f"HBM ({HLO_TEXT})"
    covers = (
        ["compute"]
        + ([hbm] if hbm_s is not None else [])
        + (["collectives"] if comm_s is not None else [])
    )
    return {
        "collectives": coll,
        "moe_layers": moe_layer_costs(ops),
        "contended_scatters": [
            {**dataclasses.asdict(s), "contention": s.contention, "text": s.describe()}
            for s in contention.contended_scatters(hlo_text)
        ],
        "matmul_flops_by_type": hlo_costs.matmul_flops_by_type(hlo_text),
        "per_step": {
            "flops": totals["flops"],
            "bytes": totals["bytes"],
            "cycles": totals["cycles"],
            "looped": any(op.trips > 1 for op in ops),
            "bytes_by_part": hlo_costs.bytes_by_part(ops),
        },
        "estimate": {
            "compute_s": compute_s,
            "hbm_s": hbm_s,
            "collectives_s": comm_s,
            "covers": covers,
            "step_s": step_s,
            "tokens_per_s": tokens_per_step / step_s if step_s else None,
        },
    }


def moe_layer_costs(ops: list[hlo_costs.Op]) -> dict[str, float]:
    """The MoE layers' share of a compiled step, from its scheduled operations ``ops``
    (``hlo_costs.parse``: one read of each operand, one write of each result): ``hlo_bytes``
    of the operations whose JAX source lies in a MoE layer (module path ``.../ffn/moe/...``,
    forward and backward) against the step's ``step_hlo_bytes``, the part of them that
    gathers, scatters or sorts (``indexed_bytes``) and their matmul ``flops``."""
    step, moe = hlo_costs.summary(ops), hlo_costs.summary_of(ops, MOE_SOURCE)
    return {
        "hlo_bytes": moe["bytes"],
        "step_hlo_bytes": step["bytes"],
        "indexed_bytes": moe["indexed_bytes"],
        "flops": moe["flops"],
    }
