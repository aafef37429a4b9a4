"""The compile report as printed: one block per compiled step (memory against the device's,
collectives, FLOPs and bytes, the roofline estimate, contended scatters, matmul FLOPs by
operand type, the MoE layers' share), then the verdict (:func:`format_report`, of a
:func:`moe_jax.compile.aot.compile_run` report), in plain units (:func:`quantity`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from moe_jax import hardware
from moe_jax.compile.contention import CONTENTION_LIMIT
from moe_jax.compile.step_analysis import HLO_TEXT


def format_report(report: Mapping[str, Any]) -> str:
    """The printed report: one block per step, then the verdict."""
    lines = [
        f"target {report['target']}: {report['devices']} x {report['device_kind']}, mesh "
        f"{report['mesh_shape']}; {report['parameters']:,} parameters; batch "
        f"{report['batch_size']} x {report['task_feature_lengths']}; activations "
        f"{report['activation_dtype']}",
        f"MoE layer for {report['moe_layer']['platform']}: dispatch="
        f"{report['moe_layer']['dispatch']!r}, "
        f"per_expert_loop={report['moe_layer']['per_expert_loop']}",
    ]
    for name, step in report["steps"].items():
        b, est = step["bytes"], step["estimate"]
        if est is None:  # the compiler refused it for lack of memory
            lines += [
                f"{name} step, per device: params + optimizer {gib(b['params_and_optimizer'])}, "
                f"temporaries {gib(b['temporaries'])}: DOES NOT FIT {gib(b['device_memory'])}",
                f"  compiler: {step['compiler_error']}",
            ]
            continue
        coll = (
            ", ".join(f"{c['count']} {kind}" for kind, c in step["collectives"].items()) or "none"
        )
        lines += [
            f"{name} step (compiled in {step['compile_s']:.1f} s), per device:",
            f"  params + optimizer {gib(b['params_and_optimizer'])}, arguments "
            f"{gib(b['arguments'])}, temporaries {gib(b['temporaries'])}",
            f"  total {gib(b['total'])} of {gib(b['device_memory'])} "
            f"({100 * b['total'] / b['device_memory']:.0f}%): "
            f"{'fits' if step['fits'] else 'DOES NOT FIT'}",
            f"  collectives: {coll}",
            f"  {quantity(step['flops_per_step'], 'FLOP')} per step (model); HLO per device: "
            + (
                f"{quantity(step['hlo_flops_per_device'], 'FLOP')}, "
                f"{quantity(step['hlo_bytes_accessed_per_device'], 'B')} accessed"
                if step["hlo_flops_per_device"] is not None
                or step["hlo_bytes_accessed_per_device"] is not None
                else "FLOPs and bytes accessed unknown (the compiler gave no cost analysis)"
            ),
            *per_step_lines(step.get("per_step")),
            estimate_line(est),
            *contention_lines(step["contended_scatters"]),
            matmul_type_line(step["matmul_flops_by_type"]),
        ]
        moe = step["moe_layers"]
        if moe["hlo_bytes"]:
            lines.append(
                f"  MoE layers: {quantity(moe['hlo_bytes'], 'B')} of the step's "
                f"{quantity(moe['step_hlo_bytes'], 'B')} of HLO operand/result bytes "
                f"({100 * moe['hlo_bytes'] / moe['step_hlo_bytes']:.0f}%; gathers/scatters/sorts "
                f"{quantity(moe['indexed_bytes'], 'B')}), {quantity(moe['flops'], 'FLOP')} of "
                f"matmuls"
            )
    if report["fits"]:
        lines.append("verdict: fits")
    else:
        lines.append("verdict: DOES NOT FIT. Change one of:")
        lines += [f"  - {a}" for a in report["advice"]]
    return "\n".join(lines)


def contention_lines(contended: list[Mapping[str, Any]]) -> list[str]:
    """The report's lines on a step's contended scatters (``step_analysis.hlo_analysis``): one when
    there are none, else one naming each, with its source line."""
    if not contended:
        return [f"  contended scatters (> {CONTENTION_LIMIT:g} updates per element): none"]
    return [
        f"  CONTENDED SCATTERS: {len(contended)} add more than {CONTENTION_LIMIT:g} updates per "
        "element they write (serialised atomic adds on a GPU: slower than the estimate says)"
    ] + [f"    - {c['text']}" for c in contended]


PARTS = 5  # the largest parts of the model the report names


def per_step_lines(per_step: Mapping[str, Any] | None) -> list[str]:
    """The report's lines on the step's work read from its HLO text with each loop body once
    per trip, and on the largest parts of its device-memory traffic
    (``step_analysis.hlo_analysis``'s ``per_step``; none for a report written before it)."""
    if not per_step:
        return []
    cycles = (
        f", TPU compiler's estimate {quantity(per_step['cycles'], 'cycles')}"
        if per_step["cycles"]
        else ""
    )
    looped = " (loops run their body once per trip: XLA's cost analysis counts it once)"
    lines = [
        f"  HLO text per device and step: {quantity(per_step['flops'], 'FLOP')} of matmuls, "
        f"{quantity(per_step['bytes'], 'B')} of device memory read and written{cycles}"
        + (looped if per_step["looped"] else "")
    ]
    parts = per_step.get("bytes_by_part") or {}
    total = sum(parts.values())
    if total:
        shares = [f"{name} {100 * b / total:.0f}%" for name, b in list(parts.items())[:PARTS]]
        lines.append(f"  its device memory by part: {', '.join(shares)}")
    return lines


def matmul_type_line(by_type: Mapping[str, float]) -> str:
    """The report's line on a step's matmul FLOPs by operand type (``step_analysis.hlo_analysis``),
    largest share first: ``matmul FLOPs by operand type: bf16 96.9%, f32 3.1%``."""
    total = sum(by_type.values())
    if not total:
        return "  matmul FLOPs by operand type: no matmuls"
    shares = sorted(by_type.items(), key=lambda kv: -kv[1])
    return "  matmul FLOPs by operand type: " + ", ".join(
        f"{kind} {100 * flops / total:.1f}%" for kind, flops in shares if flops
    )


_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def quantity(value: float | None, unit: str, missing: str = "unknown") -> str:
    """``value`` with a decimal prefix and 3 significant digits (``7.06e8, "FLOP"`` ->
    ``706 MFLOP``; ``0.0346e9, "B"`` -> ``34.6 MB``); ``missing`` when None."""
    if value is None:
        return missing
    scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(value) >= s), (1.0, ""))
    return f"{plain(value / scale)} {prefix}{unit}"


def plain(value: float) -> str:
    """``value`` to 3 significant digits without an exponent (5355860 -> ``5,360,000``,
    1190.4 -> ``1,190``, 8.93e-05 -> ``0.0000893``)."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{float(f'{value:.3g}'):,.0f}"
    return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"


def estimate_line(est: Mapping[str, Any]) -> str:
    """The roofline line of a step: milliseconds per step, its terms, and tokens/s in plain
    units, saying which terms it leaves out (then both numbers are bounds). A roofline is a
    lower bound on the step time even with every term: it charges each byte and FLOP at the
    chip's peak and cannot see contention (serialised atomic adds of a scatter) or a
    kernel's efficiency; ``benchmarks/accelerator_step.py`` measures the step on a device."""
    hbm = next((term for term in est["covers"] if term.startswith("HBM")), "HBM")
    terms = [f"compute {plain(est['compute_s'] * 1e3)}"]
    terms += [f"{hbm} {plain(est['hbm_s'] * 1e3)}"] if est["hbm_s"] is not None else []
    terms += (
        [f"collectives {plain(est['collectives_s'] * 1e3)}"]
        if est["collectives_s"] is not None
        else []
    )
    left_out = [
        name
        for name, key in (("HBM", "hbm_s"), ("collectives", "collectives_s"))
        if est[key] is None
    ]
    counted = (
        f"; HBM bytes counted from the {HLO_TEXT}: the compiler gave no cost analysis"
        if hbm != "HBM"
        else ""
    )
    label = (
        f"estimate (compiled, not run{counted})"
        if not left_out
        else (
            f"estimate (compiled, not run) of {' and '.join(est['covers'])} only "
            f"({' and '.join(left_out)} time unknown: a lower bound on the step time, an upper "
            "bound on tokens/s)"
        )
    )
    rate = "unknown" if est["tokens_per_s"] is None else f"{plain(est['tokens_per_s'])} tokens/s"
    return f"  {label}: {plain(est['step_s'] * 1e3)} ms/step ({', '.join(terms)} ms), {rate}"


def gib(n: float) -> str:
    """``n`` bytes as ``1.23 GiB``."""
    return f"{n / hardware.GiB:.2f} GiB"
