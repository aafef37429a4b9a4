"""Per-operation costs read from an optimised (compiled) HLO module's text.

``compiled.cost_analysis()`` gives one total per executable (and none at all for GPU
executables compiled without a GPU); this module breaks a compiled step into the
operations the device runs, so that the largest contributors can be named:

* every *scheduled* instruction (the entry computation and the bodies of its ``while`` /
  ``call`` / ``conditional`` / async calls), with the bytes of its operands and results in
  device memory as laid out (``bf16[8,640,768]`` = 7.5 MiB): what a roofline model would
  charge it, one read of each operand and one write of each result, of the parts it
  touches: a (dynamic) slice, or a fusion using a parameter only through slices, reads the
  slices; an in-place ``dynamic-update-slice`` reads none of its buffer and writes the
  update; a loop, call or branch moves nothing itself (``_touched``). Arrays that TPU
  memory-space assignment placed in VMEM (layout ``S(1)``) are not device-memory traffic,
  and an asynchronous pair (``copy-start`` / ``copy-done``) reads its source once and writes
  its destination once (``Op.bytes``); each op runs ``Op.trips`` times per run of the
  module (below);
* the TPU compiler's own time estimate of each instruction (``estimated_cycles`` in its
  ``backend_config``), which models what a gather, scatter or sort really costs there;
* dense FLOPs of matmuls (``dot``, ``convolution`` and cuBLAS / cuDNN GEMM custom calls)
  inside each instruction, and over the module by operand type (``matmul_flops_by_type``:
  the float32 matmuls of a bfloat16 step);
* flags for operations that ``cost_analysis()`` is known to over-count
  (``sparse_core_offload``: an instruction run asynchronously on a TPU SparseCore, counted
  by the TPU cost model as gigabytes for a scatter of kilobytes; see benchmarks/RESULTS.md);
* the collective each instruction performs, starts or completes, and the bytes it moves
  per device (as :mod:`moe_jax.compile.collectives` defines them, which counts the
  collectives of the schedule from these operations).

Each :class:`Op` carries ``trips``, how many times it runs per run of the module
(:func:`moe_jax.compile.hlo_text.run_counts`), and the totals (``summary``,
``matmul_flops_by_type``, ``collectives.collective_totals``) weigh each op by it, so a
scanned step (``nn.scan`` over layers) and its unrolled twin total alike. The text is read
by :mod:`moe_jax.compile.hlo_text`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from moe_jax.compile.hlo_text import (
    CALLED,
    Line,
    Module,
    dims,
    read,
    run_counts,
    shape_bytes,
)
from moe_jax.models.flash_attention import KERNEL_MATMULS

# Instructions whose called computations are scheduled themselves (their instructions are
# ops of their own), rather than fused into the caller.
_SCHEDULES = ("while", "call", "conditional", "async-start", "call-start")
_NOT_WORK = (
    "parameter",
    "get-tuple-element",
    "bitcast",
    "constant",
    "tuple",
    "after-all",
    "partition-id",
    "replica-id",
)
COLLECTIVES = (
    "all-to-all",
    "ragged-all-to-all",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
)


_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$", "__triton_gemm")


@dataclasses.dataclass
class Op:
    """One instruction of the optimised module.

    Attributes:
      name / opcode: as in the HLO (``fusion.15``, ``fusion``).
      source: the JAX ``op_name`` of its metadata (which part of the program it came from).
      operand_bytes / output_bytes: bytes of its operands / results in device memory as
        laid out.
      cycles: the TPU compiler's estimate (0 where the backend gives none).
      flops: dense matmul FLOPs of the dots / convolutions / GEMM calls in it.
      kinds: opcodes inside it (its fused computation's, for a fusion).
      sparse_core_offload: it (or what it calls) runs on a TPU SparseCore.
      operand_alternate_bytes / output_alternate_bytes: the same for its arrays in
        another memory space (TPU VMEM), which ``operand_bytes`` / ``output_bytes`` leave out.
      element_counts: element counts of its result's and operands' (first) array shapes
        (``categorize`` finds the operations that move whole weights by them).
      collective: the collective it performs, starts or completes (one of ``COLLECTIVES``;
        "" for none): its own opcode less ``-start`` / ``-done``, or what an ``async-start``
        (and its ``-done``) or a fusion wraps; never a loop or call that holds one, nor the
        instruction inside what an ``async-start`` wraps (the start and done stand for it).
      collective_bytes: the bytes the collective moves per device (as
        :mod:`moe_jax.compile.collectives` defines them; 0 for a ``-done``), from the
        collective instruction itself (inside the fusion or async computation that wraps
        it).
      collective_chain: for one piece of an XLA:TPU asynchronous collective split over a
        chain of fusions (start, continuation fusions, done; each holds the collective and
        carries its ``chain_id``), the chain's key; "" otherwise.
      trips: how many times it runs per execution of the module: the product of the trip
        counts of the ``while`` loops around it (``hlo_text.run_counts``; 1 outside loops). The
        byte, FLOP and cycle fields are those of one run.
    """

    name: str
    opcode: str
    source: str
    operand_bytes: float
    output_bytes: float
    cycles: int
    flops: float = 0.0
    kinds: frozenset[str] = frozenset()
    sparse_core_offload: bool = False
    operands: tuple[str, ...] = ()
    element_counts: frozenset[int] = frozenset()
    operand_alternate_bytes: float = 0.0
    output_alternate_bytes: float = 0.0
    collective: str = ""
    collective_bytes: float = 0.0
    collective_chain: str = ""
    trips: int = 1

    @property
    def bytes(self) -> float:
        """One read of each operand and one write of each result in device memory; for an
        asynchronous pair (``copy-start`` / ``copy-done``, ``all-to-all-start`` / ``-done``,
        ...) the start reads its operands and the done writes its result: the tuple the start
        returns aliases its operands and the destination, and counting it (and the done's
        tuple operand) would charge a copy of X bytes 6X instead of 2X."""
        return self._once(self.operand_bytes, self.output_bytes)

    @property
    def alternate_memory_bytes(self) -> float:
        """The same count for the arrays in another memory space (TPU VMEM, ``S(1)``)."""
        return self._once(self.operand_alternate_bytes, self.output_alternate_bytes)

    def _once(self, operands: float, output: float) -> float:
        if self.opcode.endswith("-start"):
            return operands
        if self.opcode.endswith("-done"):
            return output
        return operands + output


# Larger "estimated_cycles" are sentinels (INT64_MAX for work handed to a SparseCore).
_MAX_CYCLES = 1 << 40


_SUFFIX = re.compile(r"-(start|update|done)$")


def _collective(line: Line, computation: str, module: Module) -> tuple[str, float, str]:
    """``(Op.collective, Op.collective_bytes, Op.collective_chain)`` of ``line``, an
    instruction of ``computation``."""
    kind = _SUFFIX.sub("", line.opcode)
    if line.opcode in ("async-update", "async-done"):  # completes what its start wraps
        start = module.by_name[computation].get(line.operands[0]) if line.operands else None
        found = ("", 0.0, "") if start is None else _collective(start, computation, module)
        return found[0], 0.0, ""
    if kind in COLLECTIVES:
        if line.opcode.endswith(("-update", "-done")):
            return kind, 0.0, ""
        result = line.result_type
        if line.opcode.endswith("-start"):  # an async pair: the result is the done's
            done = module.consumer[computation].get(line.name)
            result = line.result_type if done is None else done.result_type
        types = module.by_name[computation]
        sizes = [shape_bytes(types[o].result_type) if o in types else 0.0 for o in line.operands]
        moved = (
            shape_bytes(result)
            if kind == "all-gather"
            else sizes[0]
            if kind == "ragged-all-to-all" and sizes
            else sum(sizes)
        )
        chain = re.search(r'chain_id="(\d+)"', line.attributes)
        channel = re.search(r"channel_id=(\d+)", line.attributes)
        key = f"{kind}:{channel and channel.group(1)}:{chain.group(1)}" if chain else ""
        return kind, moved, key
    if line.opcode in ("async-start", "fusion"):
        for called in CALLED.findall(line.attributes):
            for inner in module.computations.get(called, []):
                found = _collective(inner, called, module)
                if found[0]:
                    return found
    return "", 0.0, ""


def _is_matmul(line: Line) -> bool:
    """A ``dot``, a ``convolution``, a GEMM library call (cuBLAS, cuDNN, Triton) or one of
    the flash-attention kernels (:func:`_flash_kernel`)."""
    if line.opcode in ("dot", "convolution"):
        return True
    if line.opcode != "custom-call":
        return False
    target = re.search(r'custom_call_target="([^"]*)"', line.attributes)
    if target is not None and target.group(1).startswith(_GEMM_TARGETS):
        return True
    return bool(_flash_kernel(line))


def _flash_kernel(line: Line) -> str:
    """The name of the :mod:`moe_jax.models.flash_attention` kernel a Pallas call runs (its
    op name: ``.../<kernel>/pallas_call``, ``.../jvp(<kernel>)/pallas_call``,
    ``.../transpose(jvp(<kernel>))/pallas_call``), or ``""``."""
    op_name = re.search(r'op_name="[^"]*[/(]([a-z0-9_]+)\)*/pallas_call"', line.attributes)
    if op_name is None or op_name.group(1) not in KERNEL_MATMULS:
        return ""
    return op_name.group(1)


def matmul_flops_by_type(hlo_text: str) -> dict[str, float]:
    """Matmul FLOPs of one run of a module (:func:`_matmul_flops` of every dot, convolution
    and GEMM call, fused ones included, times the runs of its computation:
    ``hlo_text.run_counts``) by the element type of the first operand (``bf16``, ``f32``,
    ...): in a bfloat16 step, the float32 matmuls run at a fraction of the chip's bf16
    rate."""
    computations, types, entry = read(hlo_text)
    totals: dict[str, float] = collections.defaultdict(float)
    for computation, runs in run_counts(computations, entry).items():
        for line in computations.get(computation, []):
            if _is_matmul(line) and line.operands:
                operand = types[computation].get(line.operands[0], "")
                flops = _matmul_flops(line, types[computation])
                totals[operand.lstrip("(").split("[")[0]] += flops * runs
    return dict(totals)


def _tap_fraction(line: Line, lhs: list[int]) -> float:
    """The fraction of a convolution's window taps that land on input elements rather than
    padding or base dilation: per spatial dimension, ``min(ceil(window / lhs_dilate), input
    size) / window``. XLA:TPU writes batched matmuls as convolutions whose window spans a
    batch-like dimension: over an input of size 1 padded on both sides (``size=1x12
    pad=0_0x11_11``), or base-dilated so that one tap per window is real (``size=16x12
    lhs_dilate=16x12``); each output element then sums over one tap, not the window."""
    window = re.search(r"window=\{([^}]*)\}", line.attributes)
    labels = re.search(r"dim_labels=(\w+)_", line.attributes)
    if not window or not labels:
        return 1.0
    size = re.search(r"size=([0-9x]+)", window.group(1))
    dilate = re.search(r"lhs_dilate=([0-9x]+)", window.group(1))
    if not size:
        return 1.0
    sizes = [int(d) for d in size.group(1).split("x")]
    dilations = [int(d) for d in dilate.group(1).split("x")] if dilate else [1] * len(sizes)
    spatial = {
        int(c): lhs[i] for i, c in enumerate(labels.group(1)) if c.isdigit() and i < len(lhs)
    }
    fraction = 1.0
    for k, (w, d) in enumerate(zip(sizes, dilations, strict=False)):
        fraction *= min(-(-w // d), spatial.get(k, w)) / w
    return fraction


def _matmul_flops(line: Line, types: dict[str, str]) -> float:
    """Dense FLOPs of a ``dot`` (2 x result elements x contracted size), a ``convolution``
    (2 x result elements x kernel elements per output feature), a GEMM custom call, or a
    flash-attention kernel (its matmuls over q ``[batch, q_len, heads, head_dim]`` and k
    ``[batch, k_len, heads, head_dim]``, its first two operands; causal ones counted whole)."""
    out = math.prod(dims(line.result_type))
    lhs = dims(types.get(line.operands[0], "")) if line.operands else []
    kernel = _flash_kernel(line)
    if kernel:
        keys = dims(types.get(line.operands[1], "")) if len(line.operands) > 1 else []
        if len(lhs) != 4 or len(keys) != 4:
            return 0.0
        return 2.0 * KERNEL_MATMULS[kernel] * math.prod(lhs) * keys[1]
    if line.opcode == "convolution":
        rhs = dims(types.get(line.operands[1], "")) if len(line.operands) > 1 else []
        labels = re.search(r"dim_labels=\w*_(\w+)->", line.attributes)
        out_features = (
            rhs[labels.group(1).index("o")] if labels and rhs and "o" in labels.group(1) else 1
        )
        groups = re.search(r"feature_group_count=(\d+)", line.attributes)
        flops = 2.0 * out * math.prod(rhs) / out_features / (int(groups.group(1)) if groups else 1)
        return flops * _tap_fraction(line, lhs)
    # a dot's attribute, or a GEMM custom call's backend_config
    # (``"lhs_contracting_dimensions":["1"]``)
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line.attributes)
    contracting = contracting or re.search(
        r'"lhs_contracting_dimensions":\[([0-9",]*)\]', line.attributes
    )
    if not contracting or not lhs:
        return 0.0
    return (
        2.0
        * out
        * math.prod(lhs[int(d)] for d in contracting.group(1).replace('"', "").split(",") if d)
    )


def parse(hlo_text: str) -> list[Op]:
    """The scheduled instructions of ``hlo_text`` (``compiled.as_text()``), in order."""
    computations, types, entry = read(hlo_text)
    module = Module.of(computations, types)
    runs = run_counts(computations, entry)
    # wrapped: what an async-start runs (its collective is the start's and done's, once)
    scheduled, wrapped, ops = [entry], set(), []
    for computation in scheduled:
        for line in computations[computation]:
            called = CALLED.findall(line.attributes)
            if line.opcode in _SCHEDULES:
                scheduled.extend(c for c in called if c not in scheduled)
            if line.opcode == "async-start":
                wrapped.update(called)
            if line.opcode not in _NOT_WORK:
                op = _op(line, computation, called, computation in wrapped, module)
                ops.append(dataclasses.replace(op, trips=runs[computation]))
    return ops


def _called_work(computation: str, seen: set[str], module: Module) -> tuple[set[str], float, bool]:
    """Opcodes, matmul FLOPs and SparseCore use of ``computation`` and what it calls (each
    computation once: ``seen``)."""
    kinds, flops, sparse = set(), 0.0, False
    for line in module.computations.get(computation, []):
        kinds.add(line.opcode)
        if line.opcode in ("dot", "convolution"):
            flops += _matmul_flops(line, module.types[computation])
        sparse |= "sparsecore" in line.attributes
        for called in CALLED.findall(line.attributes):
            if called not in seen:
                seen.add(called)
                k, f, s = _called_work(called, seen, module)
                kinds, flops, sparse = kinds | k, flops + f, sparse or s
    return kinds, flops, sparse


def _op(line: Line, computation: str, called: list[str], wrapped: bool, module: Module) -> Op:
    """The :class:`Op` of ``line``, a scheduled instruction of ``computation`` that calls
    ``called``; ``wrapped``: ``computation`` is what an async start runs (its collective is
    counted at the start)."""
    types = module.types[computation]
    kinds, flops, sparse = {line.opcode}, 0.0, "sparsecore" in line.attributes
    # a fusion's work is its own; a loop's or call's is that of its scheduled instructions
    for c in [] if line.opcode in _SCHEDULES else called:
        k, f, s = _called_work(c, {c}, module)
        kinds, flops, sparse = kinds | k, flops + f, sparse or s
    if _is_matmul(line):
        flops += _matmul_flops(line, types)
    cycles = re.search(r'"estimated_cycles":"(\d+)"', line.attributes)
    source = re.search(r'op_name="([^"]*)"', line.attributes)
    operand_types = [types.get(o, "") for o in line.operands]
    kind, moved, chain = ("", 0.0, "") if wrapped else _collective(line, computation, module)
    # in every memory space, and in device memory only; of each array, the part touched
    read, written = _touched(line, operand_types, called, module)
    sizes = [shape_bytes(t) * f for t, f in zip(operand_types, read, strict=True)]
    device_sizes = [
        shape_bytes(t, hbm_only=True) * f for t, f in zip(operand_types, read, strict=True)
    ]
    output_all = shape_bytes(line.result_type) * written
    output_device = shape_bytes(line.result_type, hbm_only=True) * written
    counts = frozenset(math.prod(dims(t)) for t in (line.result_type, *operand_types) if dims(t))
    return Op(
        name=line.name,
        opcode=line.opcode,
        source=source.group(1) if source else "",
        operand_bytes=sum(device_sizes),
        output_bytes=output_device,
        cycles=int(cycles.group(1)) if cycles and int(cycles.group(1)) < _MAX_CYCLES else 0,
        flops=flops,
        kinds=frozenset(kinds),
        sparse_core_offload=sparse,
        operands=line.operands,
        element_counts=counts,
        operand_alternate_bytes=sum(sizes) - sum(device_sizes),
        output_alternate_bytes=output_all - output_device,
        collective=kind,
        collective_bytes=moved,
        collective_chain=chain,
    )


_SLICES = ("slice", "dynamic-slice")
# Ops that read only the elements they return of their first operand: slices, and gathers
# (a take along an axis, an embedding lookup: the indexed rows, not the whole table).
_PARTIAL_READS = (*_SLICES, "gather")


def _touched(
    line: Line, operand_types: list[str], called: list[str], module: Module
) -> tuple[list[float], float]:
    """The fraction of each operand of ``line`` that it reads, and of its result that it
    writes: a (dynamic) slice or a gather reads the elements it returns of its operand; a
    ``dynamic-update-slice`` updates its operand in place (reads none of it, writes the
    update); a fusion, the same by how its fused computation uses each parameter (only
    through slices and gathers, or as the buffer of an in-place update) and by its root (or
    each element of a root tuple). A loop, call or branch moves nothing itself: what its
    computations' instructions touch is theirs. Any other instruction reads and writes all
    of each array."""
    read, written = [1.0] * len(line.operands), 1.0
    if line.opcode in ("while", "call", "conditional"):
        return [0.0] * len(line.operands), 0.0
    if line.opcode == "fusion" and called:
        lines = module.computations.get(called[0], [])
        by_name = {ln.name: ln for ln in lines}
        users: dict[str, list[Line]] = collections.defaultdict(list)
        for ln in lines:
            for operand in ln.operands:
                users[operand].append(ln)
        for ln in lines:
            if ln.opcode == "parameter" and ln.parameter_number < len(read):
                whole = shape_bytes(ln.result_type) or 1.0
                read[ln.parameter_number] = min(1.0, _bytes_read(ln.name, users) / whole)
        root = next((ln for ln in lines if ln.root), None)
        if root is not None:
            written = _bytes_written(root, by_name) / (shape_bytes(root.result_type) or 1.0)
    elif line.opcode in _PARTIAL_READS and operand_types:
        whole = shape_bytes(operand_types[0]) or 1.0
        read[0] = min(1.0, shape_bytes(line.result_type) / whole)
    elif line.opcode == "dynamic-update-slice" and len(operand_types) > 1:
        read[0] = 0.0
        written = shape_bytes(operand_types[1]) / (shape_bytes(line.result_type) or 1.0)
    return read, written


def _bytes_read(name: str, users: dict[str, list[Line]]) -> float:
    """Bytes a fused computation reads of its array ``name``: the slices and gathered
    elements taken of it where those (through bitcasts) and in-place updates are all its
    uses, else all of it."""
    total = 0.0
    for user in users.get(name, []):
        if user.opcode == "bitcast":
            total += _bytes_read(user.name, users)
        elif user.opcode in _PARTIAL_READS and user.operands[0] == name:
            total += shape_bytes(user.result_type)
        elif not (user.opcode == "dynamic-update-slice" and user.operands[0] == name):
            return math.inf
    return total


def _bytes_written(line: Line, by_name: dict[str, Line]) -> float:
    """Bytes a fused computation's root ``line`` writes: an in-place update's update, each
    element of a tuple so, through bitcasts; else all of its result."""
    if line.opcode == "tuple":
        return sum(_bytes_written(by_name[o], by_name) for o in line.operands if o in by_name)
    if line.opcode == "bitcast" and line.operands and line.operands[0] in by_name:
        return _bytes_written(by_name[line.operands[0]], by_name)
    if line.opcode == "dynamic-update-slice" and line.operands[1] in by_name:
        return shape_bytes(by_name[line.operands[1]].result_type)
    return shape_bytes(line.result_type)


# Opcodes whose data movement depends on indices: a cost model may charge them for the
# whole buffer they index into, or for tiles rather than rows.
INDEXED_KINDS = frozenset({"gather", "scatter", "sort", "dynamic-slice", "dynamic-update-slice"})


def summary(ops: list[Op]) -> dict[str, float]:
    """Totals per run of the module, each op weighed by its ``trips``: ``bytes`` (one
    read per operand, one write per result in device memory, all scheduled ops),
    ``alternate_memory_bytes`` (the same in TPU VMEM), ``flops`` (matmuls), ``cycles`` (TPU
    estimate), ``indexed_bytes`` (ops holding a gather, scatter, sort or dynamic slice) and
    ``sparse_core_ops``."""
    return {
        "bytes": sum(op.bytes * op.trips for op in ops),
        "alternate_memory_bytes": sum(op.alternate_memory_bytes * op.trips for op in ops),
        "flops": sum(op.flops * op.trips for op in ops),
        "cycles": float(sum(op.cycles * op.trips for op in ops)),
        "indexed_bytes": sum(op.bytes * op.trips for op in ops if op.kinds & INDEXED_KINDS),
        "sparse_core_ops": float(sum(op.sparse_core_offload * op.trips for op in ops)),
    }


_METHOD = re.compile(r"^[A-Z]\w*\.\w+$")  # a Flax module's method in an op name: Model.encode
_LAYER = re.compile(r"^layers_[\d_]+$")
_CONTROL = frozenset({"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation"})


def part(source: str) -> str:
    """The part of the model an op's JAX source names, forward and backward alike: the
    layers' block (``encoder self_attention``; a scan's ``layers_0_4_8`` as any layer), else
    the first two module names below the model's method (``decoder token_embedder``), else
    ``outside the model`` (the loss, the optimizer's update)."""
    names = source.split("/")
    start = next((i for i, name in enumerate(names) if _METHOD.match(name)), None)
    if start is None:
        return "outside the model"
    path = [n for n in names[start + 1 : -1] if "(" not in n and n not in _CONTROL]
    path = [n for n in path if not n.startswith("scan_")]
    layer = next((i for i, name in enumerate(path) if _LAYER.match(name)), None)
    if layer is not None and layer + 1 < len(path):
        return " ".join([*path[:layer], path[layer + 1]])
    return " ".join(path[:2]) or "model"


def bytes_by_part(ops: list[Op]) -> dict[str, float]:
    """Device-memory bytes per run of the module by :func:`part` of the model, largest
    first: where a step's memory traffic goes."""
    totals: dict[str, float] = collections.defaultdict(float)
    for op in ops:
        totals[part(op.source)] += op.bytes * op.trips
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def summary_of(ops: list[Op], source_contains: str) -> dict[str, float]:
    """``summary`` of the operations whose JAX source names ``source_contains`` (e.g.
    ``"MoeLayer"``: the MoE layers' share of a compiled train step)."""
    return summary([op for op in ops if source_contains in op.source])


CATEGORIES = (
    "matmuls",
    "gather / scatter / sort",
    "whole weights (casts, gradients)",
    "collectives",
    "other",
)


def categorize(op: Op, weight_sizes: frozenset[int]) -> str:
    """The category of ``op`` in a layer's cost breakdown (first that applies): ``matmuls``
    (it holds a dot, convolution or GEMM call), ``gather / scatter / sort`` (an indexed
    operation, ``INDEXED_KINDS``), ``whole weights`` (no matmul, but it reads or writes an
    array with as many elements as a parameter, ``weight_sizes``: the float32-to-bfloat16
    casts of the weights and the writes and conversions of their gradients),
    ``collectives`` (``Op.collective``), else ``other`` (element-wise work, reductions, copies)."""
    if op.flops > 0:
        return CATEGORIES[0]
    if op.kinds & INDEXED_KINDS:
        return CATEGORIES[1]
    if op.element_counts & weight_sizes:
        return CATEGORIES[2]
    if op.collective:
        return CATEGORIES[3]
    return CATEGORIES[4]
