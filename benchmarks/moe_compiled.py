"""The MoE layer compiled for a TPU or GPU target from this CPU: where the bytes go.

Usage (TPU; libtpu importable, e.g. PYTHONPATH=.:.venv/compilers/tpu after `make compilers`; add
ALLOW_MULTIPLE_LIBTPU_LOAD=1 when another process has libtpu loaded):
  TPU_SKIP_MDS_QUERY=1 JAX_PLATFORMS=cpu python benchmarks/moe_compiled.py --target tpu:v5p:2x2x1
GPU (the CUDA PJRT plugin importable; no GPU needed):
  JAX_PLATFORMS=cpu python benchmarks/moe_compiled.py --target gpu:h100
Expert parallelism only (no single-device table), over all devices of the target:
  python benchmarks/moe_compiled.py --target tpu:v5p:2x2x1 --experts --expert-parallel 8
  python benchmarks/moe_compiled.py --target gpu:h100:8 --experts --expert-parallel 8

Compiles forward + backward with a cotangent (``value_and_grad`` of ``sum(y * r)``) of the
MoE layer at the T5-Base shape (8 x 512 tokens, d_model 768, d_ff 2048, top-2, capacity
factor 1.25, T5X capacity rule, one routing group, bfloat16 compute; the weights as the
train step passes them: the bfloat16 compute copies of those the layer reads cast,
``moe_jax.runtime.compute_copies``, with ``--weights float32`` float32 weights cast at each
call) on ONE device of the target, for each dispatch and E, beside a dense ReLU FFN of the same
expert-matmul FLOPs (hidden = d_ff x E x capacity / tokens). Nothing runs: every number is
read from the compiled executable (``cost_analysis()``, ``memory_analysis()``, the
optimised HLO through ``moe_jax.compile.hlo_costs``).

Columns: FLOPs and bytes as ``cost_analysis()`` reports them (TPU only: the GPU client
returns none); ``HLO bytes``: one read of every operand and one write of every result of
each scheduled operation (what the program moves if every op streams its operands once);
temporaries; roofline time ``max(FLOPs / peak, bytes / HBM bandwidth)`` with either bytes;
the TPU compiler's own estimate (sum of ``estimated_cycles``); each as a ratio to the dense
FFN; the number of gather, scatter and sort operations. ``floor``: the dense FFN's HLO bytes
plus, per parameter the layer has beyond the dense FFN's, one read of the weight and one
write of its gradient in the weight's dtype (4 bytes for a bfloat16 copy, 8 for float32),
as a ratio to the dense FFN: what the layer would move with a free dispatch. ``--ops N``
lists the N largest operations of each compiled layer; ``--breakdown`` splits each layer's
HLO bytes into matmuls, gathers / scatters / sorts, whole-weight casts and gradients,
collectives and the rest, beside the dense FFN's (``hlo_costs.categorize``); ``--options``
adds the routing options of docs/moe.md ("Routing of current MoE models") as ``sort`` rows;
``--dropless KERNEL ...`` adds the dropless layer (``dropless=True``) with each grouped matmul
(``ExecutionConfig.grouped_matmul``) as ``dropless:<kernel>`` rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from layer_configs import ROUTING_OPTIONS, layer_config

from moe_jax.compile import collectives, hlo_costs, targets
from moe_jax.moe import MoeLayer
from moe_jax.moe.capacity import expert_capacity
from moe_jax.moe.collections import AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION
from moe_jax.runtime import compute_copies

TOKENS = (8, 512)
D_MODEL, D_FF = 768, 2048
GIB, MIB = 2**30, 2**20

# Peak dense bfloat16 FLOP/s and HBM bytes/s per chip (vendor figures).
CHIPS = {
    "TPU v5": (459e12, 2.765e12),  # v5p
    "TPU v5 lite": (197e12, 0.819e12),  # v5e
    "TPU v6 lite": (918e12, 1.640e12),  # v6e
    "TPU v4": (275e12, 1.228e12),
    "NVIDIA H100 80GB HBM3": (989e12, 3.35e12),
}
GPU_TARGET_CONFIGS = {"h100": pathlib.Path(__file__).with_name("h100_sxm.txtpb")}


def target_devices(target: str) -> np.ndarray:
    """Devices of ``tpu:<chip>:<topology>`` (e.g. ``tpu:v5p:2x2x1``), ``gpu:h100`` (one
    H100 SXM, ``h100_sxm.txtpb``) or ``gpu:<chip>:<count>`` (``targets.target_devices``),
    from this CPU."""
    from jax.experimental import topologies

    kind, _, name = target.partition(":")
    if kind == "tpu" or target.count(":") == 2:
        return np.array(targets.target_devices(targets.parse_target(target)))
    if kind == "gpu" and name in GPU_TARGET_CONFIGS:
        return np.array(
            topologies.get_topology_desc(
                platform="cuda",
                topology_name=name,
                topology="1x1x1",
                target_config=GPU_TARGET_CONFIGS[name].read_text(),
            ).devices
        )
    raise ValueError(
        f"--target={target!r}: expected tpu:<chip>:<topology>, gpu:<chip>:<count> or "
        f"gpu:{{{','.join(GPU_TARGET_CONFIGS)}}}"
    )


@dataclasses.dataclass
class Row:
    """Costs of one compiled fwd+bwd; bytes in bytes, times in ms."""

    name: str
    flops: float
    cost_bytes: float | None
    hlo_bytes: float
    temp_bytes: float
    cycles: float
    sparse_core_ops: int
    param_bytes: int
    ops: list[hlo_costs.Op] = dataclasses.field(repr=False)
    weight_sizes: frozenset[int] = frozenset()

    def by_category(self) -> dict[str, tuple[float, float]]:
        """``{category: (HLO bytes, TPU estimated cycles)}`` (``hlo_costs.categorize``)."""
        totals = dict.fromkeys(hlo_costs.CATEGORIES, (0.0, 0.0))
        for op in self.ops:
            category = hlo_costs.categorize(op, self.weight_sizes)
            totals[category] = (totals[category][0] + op.bytes, totals[category][1] + op.cycles)
        return totals

    def indexed_ops(self) -> str:
        """``gathers / scatters / sorts``: how many operations of each kind the step holds."""
        counts = [
            sum(kind in op.kinds for op in self.ops) for kind in ("gather", "scatter", "sort")
        ]
        return " / ".join(map(str, counts))

    def roofline_ms(self, chip: tuple[float, float], bytes_: float | None) -> float | None:
        return None if bytes_ is None else 1e3 * max(self.flops / chip[0], bytes_ / chip[1])


def moe_step(experts: int, dispatch: str, **parts: dict):
    """``(apply, params, x)`` of the layer (``layer_config`` with ``parts``, batched expert
    matmuls); ``apply(params, x) -> (y, state)``, ``state`` the
    updated non-parameter collections (the balancing bias), returned so that the compiled
    step keeps their update."""
    parts.setdefault("execution", dict(per_expert_loop=False))
    layer = MoeLayer(layer_config(experts, D_FF, dispatch, **parts), dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((*TOKENS, D_MODEL), jnp.bfloat16)
    variables = nn.unbox(jax.eval_shape(layer.init, jax.random.PRNGKey(0), x))
    sown = ("params", AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION)
    state = {k: v for k, v in variables.items() if k not in sown}

    def apply(p, x):
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state)
        y, updated = layer.apply(
            {"params": p, **zeros},
            x,
            deterministic=False,
            mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION, *state],
        )
        return y, {k: updated[k] for k in state}

    return apply, variables["params"], x


def dense_step(hidden: int):
    x = jax.ShapeDtypeStruct((*TOKENS, D_MODEL), jnp.bfloat16)
    params = {
        "wi": jax.ShapeDtypeStruct((D_MODEL, hidden), jnp.float32),
        "wo": jax.ShapeDtypeStruct((hidden, D_MODEL), jnp.float32),
    }

    def apply(p, x):
        return jnp.maximum(x @ p["wi"].astype(x.dtype), 0) @ p["wo"].astype(x.dtype), {}

    return apply, params, x


def compile_row(name: str, apply, params, x, mesh, weights: str = "copies") -> Row:
    """The fwd+bwd of ``apply`` compiled on ``mesh``; ``weights='copies'``: each weight
    ``apply`` only reads cast passed in that dtype, as the train step's compute copies
    (``compute_copies.read_as_copies``); ``'float32'``: float32, cast at each call."""

    def loss(p, x, r):
        y, state = apply(p, x)
        return jnp.sum(y.astype(jnp.float32) * r), state

    def step(p, x, r):
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x, r)

    r = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    with jax.set_mesh(mesh):
        if weights == "copies":  # as the train step passes them
            params = compute_copies.read_as_copies(apply, params, x)
        compiled = jax.jit(step).lower(params, x, r).compile()
    cost = compiled.cost_analysis() or {}
    ops = hlo_costs.parse(compiled.as_text())
    totals = hlo_costs.summary(ops)
    return Row(
        name=name,
        flops=cost.get("flops", totals["flops"]),
        cost_bytes=cost.get("bytes accessed"),
        hlo_bytes=totals["bytes"],
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
        cycles=totals["cycles"],
        sparse_core_ops=int(totals["sparse_core_ops"]),
        param_bytes=sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params)),
        ops=ops,
        weight_sizes=frozenset(
            p.size for p in jax.tree.leaves(params) if p.ndim >= 2 and p.size > 2**16
        ),
    )


def all_to_all_traffic(ops: list[hlo_costs.Op]) -> dict[str, float]:
    """The all-to-alls, plain and ragged, of a compiled step (``collectives.collectives``, the
    count and bytes of ``moe-jax compile``'s report): ``count``, ``ragged`` (how many of them
    are ragged), ``bytes`` moved per device, ``async`` (how many have work scheduled between
    their start and done), ``ops_between`` and ``flops_between`` (that work)."""
    found = [
        c for c in collectives.collectives(ops) if c.kind in ("all-to-all", "ragged-all-to-all")
    ]
    return {
        "count": len(found),
        "ragged": sum(c.kind == "ragged-all-to-all" for c in found),
        "bytes": sum(c.bytes for c in found),
        "async": sum(c.overlapped_ops > 0 for c in found),
        "ops_between": sum(c.overlapped_ops for c in found),
        "flops_between": sum(c.overlapped_flops for c in found),
    }


def expert_parallel_rows(devices: np.ndarray, experts: int, dispatches: list[str]) -> None:
    """All-to-all traffic and overlap of the layer under expert parallelism over every
    device of the target (mesh (1, N, 1)), N x 8 x 512 tokens (4096 per device, one group),
    per dispatch, then dropless two ways: ``sort`` with capacity = the group (fixed buffers:
    what ``dropless=True`` compiles to on CPU, and did everywhere before the ragged path) and
    ``dropless=True`` (on TPU: rows by ``ragged_all_to_all`` into ``ragged_dot``; elsewhere the
    same buffers as the row before: ``execution.resolve_plan``).

    ``MiB sent``: the bytes of the all-to-alls (``all_to_all_traffic``: their operands, for a
    ragged all-to-all its first operand, the rows it may send: the routed rows leave, the
    rest of the buffer does not; the definition of ``moe_jax.compile.collectives``).
    """
    n = devices.size
    mesh = jax.sharding.Mesh(devices.reshape(1, n, 1), ("data", "expert", "model"))
    print(
        f"\nexpert parallelism over {n} devices, mesh (1, {n}, 1), E = {experts}, "
        f"{n} x 8 x 512 tokens"
    )
    print(
        "| layer | all-to-alls (ragged) | MiB sent per device per step "
        "| async (work between start and done) | GFLOP overlapped | GFLOP | HLO GiB | temp MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    variants = [(d, d, {}) for d in dispatches] + [
        (
            "sort, capacity = group (padded dropless)",
            "sort",
            {"capacity": {"train_capacity_factor": float(experts)}},
        ),
        ("sort, dropless=True", "sort", {"capacity": {"dropless": True}}),
    ]
    for label, dispatch, options in variants:
        apply, params, x = moe_step(experts, dispatch, **options)
        x = jax.ShapeDtypeStruct((n * TOKENS[0], *x.shape[1:]), x.dtype)
        row = compile_row(dispatch, apply, params, x, mesh)
        a2a = all_to_all_traffic(row.ops)
        print(
            f"| {label} | {a2a['count']} ({a2a['ragged']}) | {a2a['bytes'] / MIB:.1f} | "
            f"{a2a['async']} of {a2a['count']} ({a2a['ops_between']} ops) | "
            f"{a2a['flops_between'] / 1e9:.1f} | {row.flops / 1e9:.1f} | "
            f"{row.hlo_bytes / GIB:.3f} | {row.temp_bytes / MIB:.1f} |",
            flush=True,
        )


def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or not b else f"{a / b:.2f}x"


def _gib(b: float | None) -> str:
    return "" if b is None else f"{b / GIB:.3f}"


def print_ops(row: Row, count: int) -> None:
    print(f"\n{row.name}: {count} largest operations by TPU estimated cycles (else HLO bytes)")
    print("| op | cycles | HLO MiB | GFLOP | indexed | SparseCore | source |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for op in sorted(row.ops, key=lambda o: (-o.cycles, -o.bytes))[:count]:
        indexed = ",".join(sorted(op.kinds & hlo_costs.INDEXED_KINDS))
        print(
            f"| {op.name} | {op.cycles} | {op.bytes / MIB:.1f} | {op.flops / 1e9:.2f} "
            f"| {indexed} | "
            f"{'yes' if op.sparse_core_offload else ''} | {op.source[-70:]} |"
        )


def print_breakdown(rows: list[Row]) -> None:
    """HLO bytes (and TPU estimated cycles) of each layer by category, beside the dense FFN
    (``rows[0]``): which operations make up the excess over it."""
    dense = rows[0].by_category()
    dense_total = sum(b for b, _ in dense.values())
    for row in rows[1:]:
        ours = row.by_category()
        excess = sum(b for b, _ in ours.values()) - dense_total
        print(
            f"\n{row.name}: HLO bytes by category vs {rows[0].name} "
            f"(excess {excess / MIB:.0f} MiB = {excess / dense_total:.2f}x the dense FFN's bytes)"
        )
        print(
            "| category | dense MiB | layer MiB | excess MiB | share of the excess "
            "| TPU est. kcycles dense / layer |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for category in hlo_costs.CATEGORIES:
            (db, dc), (lb, lc) = dense[category], ours[category]
            share = f"{(lb - db) / excess:.0%}" if excess else ""
            print(
                f"| {category} | {db / MIB:.0f} | {lb / MIB:.0f} | {(lb - db) / MIB:+.0f} "
                f"| {share} | "
                f"{dc / 1e3:.0f} / {lc / 1e3:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tpu:v5p:2x2x1", help="tpu:<topology> or gpu:h100")
    parser.add_argument(
        "--experts",
        type=int,
        nargs="*",
        default=[8, 32, 64],
        help="E of the single-device table (none: skip it)",
    )
    parser.add_argument("--dispatch", nargs="+", default=["auto", "sort", "einsum"])
    parser.add_argument(
        "--ops", type=int, default=0, help="list the N largest operations of each layer"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="each layer's HLO bytes by category (matmuls, indexed, whole weights, ...) "
        "vs the dense FFN",
    )
    parser.add_argument(
        "--options",
        action="store_true",
        help="add the routing options of layer_configs.ROUTING_OPTIONS as `sort` rows",
    )
    parser.add_argument(
        "--weights",
        choices=("copies", "float32"),
        default="copies",
        help="the layer's weights as the train step passes them (bfloat16 compute copies of "
        "those it reads cast), or float32 weights cast at each call",
    )
    parser.add_argument(
        "--dropless",
        nargs="*",
        default=[],
        metavar="KERNEL",
        help="add the dropless layer with each of these grouped matmuls (xla, pallas, ...)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write the table here")
    parser.add_argument(
        "--expert-parallel",
        type=int,
        default=0,
        metavar="E",
        help="also compile the layer with E experts split over all the target's devices",
    )
    args = parser.parse_args()

    devices = target_devices(args.target)
    device = devices.flat[0]
    chip = CHIPS[device.device_kind]
    mesh = jax.sharding.Mesh(devices.flat[:1].reshape(1, 1, 1), ("data", "expert", "model"))
    print(
        f"target {args.target}: {device.device_kind} ({device.platform}), one device; peak "
        f"{chip[0] / 1e12:.0f} TFLOP/s bf16, HBM {chip[1] / 1e12:.2f} TB/s; "
        f"compiled from a CPU host (nothing ran on the target)"
    )
    if args.experts:
        print(
            "| E | layer | GFLOP | cost-analysis GiB | HLO GiB | temp MiB "
            "| roofline ms (cost / HLO bytes) | vs dense (cost / HLO) | TPU est. cycles vs dense "
            "| floor vs dense | SparseCore ops | gathers / scatters / sorts |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    table, compiled = [], []
    tokens = TOKENS[0] * TOKENS[1]
    for experts in args.experts:
        capacity = expert_capacity(tokens, experts, 2, 1.25, 4, "t5x")
        hidden = D_FF * experts * capacity // tokens
        rows = [compile_row(f"dense FFN (d_ff {hidden})", *dense_step(hidden), mesh, args.weights)]
        for dispatch in args.dispatch:
            start = time.perf_counter()
            rows.append(compile_row(dispatch, *moe_step(experts, dispatch), mesh, args.weights))
            rows[-1].name += f" (compile {time.perf_counter() - start:.0f} s)"
        for label, options in ROUTING_OPTIONS.items() if args.options else ():
            layer = moe_step(experts, "sort", **options)
            rows.append(compile_row(f"sort, {label}", *layer, mesh, args.weights))
        for kernel in args.dropless:
            execution = dict(per_expert_loop=False, grouped_matmul=kernel)
            layer = moe_step(experts, "sort", capacity={"dropless": True}, execution=execution)
            rows.append(compile_row(f"dropless:{kernel}", *layer, mesh, args.weights))
        dense = rows[0]
        for row in rows:
            cost_ms, hlo_ms = (
                row.roofline_ms(chip, row.cost_bytes),
                row.roofline_ms(chip, row.hlo_bytes),
            )
            floor = dense.hlo_bytes + 2 * (row.param_bytes - dense.param_bytes)
            dense_cost_ms, dense_hlo_ms = (
                dense.roofline_ms(chip, dense.cost_bytes),
                dense.roofline_ms(chip, dense.hlo_bytes),
            )
            print(
                f"| {experts} | {row.name} | {row.flops / 1e9:.1f} | {_gib(row.cost_bytes)} "
                f"| {_gib(row.hlo_bytes)} | {row.temp_bytes / MIB:.1f} "
                f"| {'' if cost_ms is None else f'{cost_ms:.3f}'} / {hlo_ms:.3f} | "
                f"{_ratio(cost_ms, dense_cost_ms)} / {_ratio(hlo_ms, dense_hlo_ms)} | "
                f"{_ratio(row.cycles or None, dense.cycles)} | "
                f"{_ratio(floor, dense.hlo_bytes)} | "
                f"{row.sparse_core_ops} | {row.indexed_ops()} |",
                flush=True,
            )
            table.append(
                dict(
                    target=args.target,
                    device=device.device_kind,
                    experts=experts,
                    layer=row.name,
                    flops=row.flops,
                    cost_bytes=row.cost_bytes,
                    hlo_bytes=row.hlo_bytes,
                    temp_bytes=row.temp_bytes,
                    roofline_ms_cost=cost_ms,
                    roofline_ms_hlo=hlo_ms,
                    tpu_cycles=row.cycles,
                    sparse_core_ops=row.sparse_core_ops,
                    indexed_ops=row.indexed_ops(),
                )
            )
        compiled.append(rows)
    for rows in compiled:  # after the table, so that its rows stay one Markdown table
        if args.ops:
            for row in rows:
                print_ops(row, args.ops)
        if args.breakdown:
            print_breakdown(rows)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    if args.expert_parallel:
        expert_parallel_rows(devices, args.expert_parallel, args.dispatch)


if __name__ == "__main__":
    main()
