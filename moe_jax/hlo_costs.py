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
  module (loops, below);
* the TPU compiler's own time estimate of each instruction (``estimated_cycles`` in its
  ``backend_config``), which models what a gather, scatter or sort really costs there;
* dense FLOPs of matmuls (``dot``, ``convolution`` and cuBLAS / cuDNN GEMM custom calls)
  inside each instruction, and over the module by operand type (``matmul_flops_by_type``:
  the float32 matmuls of a bfloat16 step);
* flags for operations that ``cost_analysis()`` is known to over-count
  (``sparse_core_offload``: an instruction run asynchronously on a TPU SparseCore, counted
  by the TPU cost model as gigabytes for a scatter of kilobytes; see benchmarks/RESULTS.md);
* the collectives of the schedule (``collectives``, ``collective_totals``): the one count of
  collectives and their bytes that ``moe-jax compile``'s report and the benchmarks use.

Collective bytes: per device, the size of the larger of the collective's data buffers, the
message size that NCCL's and XLA's bandwidth formulas take (the time on a link is this size
times a factor of the algorithm and the device count, ``(n-1)/n`` for a ring all-gather or
reduce-scatter, ``2(n-1)/n`` for a ring all-reduce; the roofline estimate divides it by the
link bandwidth, factor 1):

* ``all-reduce``, ``all-to-all``, ``collective-permute``, ``reduce-scatter``: the operands
  (for all-reduce, all-to-all and collective-permute as large as the result; for
  reduce-scatter the whole array before it is scattered, ``n`` x the result);
* ``all-gather``: the result (``n`` x the operand: what every device ends up holding);
* ``ragged-all-to-all``: its first operand, the rows it may send (the second is the receive
  buffer, sized for the worst case and only written; the rest are offsets and sizes): an
  upper bound on what it moves, and the tight one when every row is routed.

Arrays in any memory space count (a TPU collective may read or write VMEM, ``S(1)``), not the
``u32`` sync flags of an asynchronous start's tuple, which are no operand or result of the
collective; the bytes are those of the collective instruction itself, not of the fusion or
async computation that wraps it. Each collective counts once: an asynchronous pair
(``all-to-all-start`` / ``-done``, XLA:GPU's ``async-start`` wrapping a collective), and
an XLA:TPU asynchronous collective split over a chain of fusions (the start, continuation
fusions that run other work while it progresses, the done: each holds the collective
instruction, all with the same ``chain_id``), which counts at its first piece with the
work scheduled up to its last as overlap. A loop or call holding a collective is not one.

Loops: an instruction in a ``while`` body runs once per trip. Each :class:`Op` carries
``trips``, the product of the trip counts of the loops around it (``_trip_count``: XLA's
``known_trip_count`` on CPU and GPU; on TPU, which prints none, read from the loop's
condition, initial value and step), and the totals (``summary``, ``collective_totals``,
``matmul_flops_by_type``) weigh each op by it, so a scanned step (``nn.scan`` over layers)
and its unrolled twin total alike. A loop whose trip count cannot be read counts once.

Why text: XLA prints the optimised module as text for every backend (``compiled.as_text()``,
what ``moe-jax compile --hlo_dir`` keeps and ``benchmarks/compile_table.py recount``
re-reads). A structured reader was tried with jax 0.10.2: jaxlib's ``HloModule`` objects
(``compiled.runtime_executable().hlo_modules()``) give instructions' names, opcodes and
operands but no shapes, so bytes still come from text; their serialized ``HloModuleProto``
parses with TensorFlow's ``hlo_pb2`` (shapes, layouts, schedule: checked for CPU and TPU
executables, not for GPU), but that costs a TensorFlow import (seconds, about 800 MB) in
``moe-jax compile``, reads a proto schema from another XLA build than jaxlib's, and cannot
re-read kept HLO text.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e4m3fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e4m3": 1,
    "f8e5m2": 1,
    "f8e5m2fnuz": 1,
    "f8e3m4": 1,
    "f8e8m0fnu": 1,
    "s4": 0.5,
    "u4": 0.5,
    "f4e2m1fn": 0.5,
    "s2": 0.25,
    "u2": 0.25,
}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_CALLED = re.compile(r"\b(?:calls|body|condition|to_apply|branch_computations)=\{?%([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
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


def shape_bytes(text: str, hbm_only: bool = False) -> float:
    """Bytes of every array shape written in ``text`` (``f32[8,512]`` = 16 KiB);
    ``hbm_only``: without the arrays a layout places in another memory space (``S(1)``: on
    TPU the on-chip VMEM that memory-space assignment prefetches into; ``S(2)``: sync
    flags), i.e. only what lives in device memory (HBM)."""
    total = 0.0
    for dtype, dims, layout in _SHAPE.findall(text):
        if hbm_only and re.search(r"S\([1-9]\)", layout):
            continue
        total += math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
    return total


def _dims(text: str) -> list[int]:
    """Dimensions of the first array shape in ``text``."""
    match = _SHAPE.search(text)
    return [] if match is None else [int(d) for d in match.group(2).split(",") if d]


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
      collective_bytes: the bytes the collective moves per device (the module docstring's
        definition; 0 for a ``-done``), from the collective instruction itself (inside the
        fusion or async computation that wraps it).
      collective_chain: for one piece of an XLA:TPU asynchronous collective split over a
        chain of fusions (start, continuation fusions, done; each holds the collective and
        carries its ``chain_id``), the chain's key; "" otherwise.
      trips: how many times it runs per execution of the module: the product of the trip
        counts of the ``while`` loops around it (``_trip_count``; 1 outside loops). The
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


def _split_operands(rest: str) -> tuple[str, str]:
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return rest[: i - 1], rest[i:]


# Larger "estimated_cycles" are sentinels (INT64_MAX for work handed to a SparseCore).
_MAX_CYCLES = 1 << 40


@dataclasses.dataclass(frozen=True)
class _Line:
    name: str
    result_type: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    root: bool = False
    # what a parameter or constant holds between its parentheses: its number, its value
    literal: str = ""

    @property
    def parameter_number(self) -> int:
        return int(self.literal) if self.opcode == "parameter" else -1


_SUFFIX = re.compile(r"-(start|update|done)$")


@dataclasses.dataclass(frozen=True)
class _Module:
    """The computations of a module (``_Line`` s by computation, and by name in each), the
    result types of each computation's instructions by name and, in each, the instruction
    that consumes each async start or update first."""

    computations: dict[str, list[_Line]]
    by_name: dict[str, dict[str, _Line]]
    consumer: dict[str, dict[str, _Line]]
    types: dict[str, dict[str, str]]

    @classmethod
    def of(cls, computations: dict[str, list[_Line]], types: dict[str, dict[str, str]]) -> _Module:
        return cls(
            computations,
            {c: {line.name: line for line in lines} for c, lines in computations.items()},
            {
                c: {
                    line.operands[0]: line
                    for line in reversed(lines)
                    if line.opcode.endswith(("-update", "-done")) and line.operands
                }
                for c, lines in computations.items()
            },
            types,
        )


def _collective(line: _Line, computation: str, module: _Module) -> tuple[str, float, str]:
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
        for called in _CALLED.findall(line.attributes):
            for inner in module.computations.get(called, []):
                found = _collective(inner, called, module)
                if found[0]:
                    return found
    return "", 0.0, ""


def _is_matmul(line: _Line) -> bool:
    """A ``dot``, a ``convolution`` or a GEMM library call (cuBLAS, cuDNN, Triton)."""
    if line.opcode in ("dot", "convolution"):
        return True
    if line.opcode != "custom-call":
        return False
    target = re.search(r'custom_call_target="([^"]*)"', line.attributes)
    return target is not None and target.group(1).startswith(_GEMM_TARGETS)


def matmul_flops_by_type(hlo_text: str) -> dict[str, float]:
    """Matmul FLOPs of one run of a module (:func:`_matmul_flops` of every dot, convolution
    and GEMM call, fused ones included, times the runs of its computation: :func:`_runs`) by
    the element type of the first operand (``bf16``, ``f32``, ...): in a bfloat16 step, the
    float32 matmuls run at a fraction of the chip's bf16 rate."""
    computations, types, entry = _read(hlo_text)
    totals: dict[str, float] = collections.defaultdict(float)
    for computation, runs in _runs(computations, entry).items():
        for line in computations.get(computation, []):
            if _is_matmul(line) and line.operands:
                operand = types[computation].get(line.operands[0], "")
                flops = _matmul_flops(line, types[computation])
                totals[operand.lstrip("(").split("[")[0]] += flops * runs
    return dict(totals)


def _tap_fraction(line: _Line, lhs: list[int]) -> float:
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


def _matmul_flops(line: _Line, types: dict[str, str]) -> float:
    """Dense FLOPs of a ``dot`` (2 x result elements x contracted size), a ``convolution``
    (2 x result elements x kernel elements per output feature) or a GEMM custom call."""
    out = math.prod(_dims(line.result_type))
    lhs = _dims(types.get(line.operands[0], "")) if line.operands else []
    if line.opcode == "convolution":
        rhs = _dims(types.get(line.operands[1], "")) if len(line.operands) > 1 else []
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


def _read(hlo_text: str) -> tuple[dict[str, list[_Line]], dict[str, dict[str, str]], str]:
    """``(instructions by computation, result types by computation and name, entry name)``
    of ``hlo_text``."""
    computations: dict[str, list[_Line]] = {}
    types: dict[str, dict[str, str]] = {}
    entry, current = None, None
    for text in hlo_text.splitlines():
        if text.startswith("ENTRY") or (text.startswith("%") and text.rstrip().endswith("{")):
            current = text.split()[1 if text.startswith("ENTRY") else 0].lstrip("%")
            computations[current], types[current] = [], {}
            entry = current if text.startswith("ENTRY") else entry
            continue
        if text.startswith("}"):
            current = None
            continue
        if current is None:
            continue
        match = _INSTRUCTION.match(text)
        if match:
            root, name, result_type, opcode, rest = match.groups()
            operands, attributes = _split_operands(rest)
            computations[current].append(
                _Line(
                    name,
                    result_type,
                    opcode,
                    tuple(re.findall(r"%([\w.\-]+)", operands)),
                    attributes,
                    root=bool(root),
                    literal=operands.strip() if opcode in ("parameter", "constant") else "",
                )
            )
            types[current][name] = result_type
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, types, entry


def parse(hlo_text: str) -> list[Op]:
    """The scheduled instructions of ``hlo_text`` (``compiled.as_text()``), in order."""
    computations, types, entry = _read(hlo_text)
    module = _Module.of(computations, types)
    runs = _runs(computations, entry)
    # wrapped: what an async-start runs (its collective is the start's and done's, once)
    scheduled, wrapped, ops = [entry], set(), []
    for computation in scheduled:
        for line in computations[computation]:
            called = _CALLED.findall(line.attributes)
            if line.opcode in _SCHEDULES:
                scheduled.extend(c for c in called if c not in scheduled)
            if line.opcode == "async-start":
                wrapped.update(called)
            if line.opcode not in _NOT_WORK:
                op = _op(line, computation, called, computation in wrapped, module)
                ops.append(dataclasses.replace(op, trips=runs[computation]))
    return ops


def _runs(computations: dict[str, list[_Line]], entry: str) -> dict[str, int]:
    """How many times each computation reachable from ``entry`` runs per run of the module:
    a ``while``'s body and condition its trip count (:func:`_trip_count`) times the runs of
    the computation holding it, any other called computation (fusion, call, branch,
    reducer) as often as its caller; the first caller found counts."""
    runs, pending = {entry: 1}, [entry]
    while pending:
        computation = pending.pop()
        lines = computations.get(computation, [])
        by_name = {line.name: line for line in lines}
        for line in lines:
            trips = _trip_count(line, by_name, computations) if line.opcode == "while" else 1
            for called in _CALLED.findall(line.attributes):
                if called not in runs:
                    runs[called] = runs[computation] * trips
                    pending.append(called)
    return runs


def _trip_count(loop: _Line, caller: dict[str, _Line], computations: dict[str, list[_Line]]) -> int:
    """The trip count of the ``while`` instruction ``loop``: XLA's ``known_trip_count`` where
    the backend prints it (CPU, GPU), else read from the loop as XLA:TPU leaves it: a
    condition ``counter < limit`` on an element of the loop state, with the limit, the
    counter's initial value (in the caller's state tuple; 0 when it is not a constant) and
    its step (the body's ``counter + step``; 1 when it is not one) constants. 1 when neither
    says."""
    known = _TRIP_COUNT.search(loop.attributes)
    if known:
        return int(known.group(1))
    condition, compare = _element(loop, "condition", computations)
    if compare is None or compare.opcode != "compare" or "direction=LT" not in compare.attributes:
        return 1
    index = _tuple_index(condition.get(compare.operands[0]))
    limit = condition.get(compare.operands[1]) if len(compare.operands) > 1 else None
    if index is None or limit is None or limit.opcode != "constant":
        return 1
    state = caller.get(loop.operands[0]) if loop.operands else None
    first = (
        caller.get(state.operands[index])
        if state is not None and state.opcode == "tuple" and index < len(state.operands)
        else None
    )
    body, root = _element(loop, "body", computations)
    step = 1
    update = body.get(root.operands[index]) if root and index < len(root.operands) else None
    if update is not None and update.opcode == "add":
        terms = [body.get(o) for o in update.operands]
        if any(_tuple_index(_unwrapped(t, body)) == index for t in terms):
            step = next((_integer(t) for t in terms if t and t.opcode == "constant"), 1) or 1
    start = _integer(first) if first is not None and first.opcode == "constant" else 0
    return max(1, -(-(_integer(limit) - start) // step))


def _element(
    loop: _Line, role: str, computations: dict[str, list[_Line]]
) -> tuple[dict[str, _Line], _Line | None]:
    """The instructions by name of the ``role`` (``condition`` / ``body``) computation of the
    ``while`` instruction ``loop``, and its root when it has operands (else None)."""
    name = re.search(role + r"=%([\w.\-]+)", loop.attributes)
    lines = computations.get(name.group(1), []) if name else []
    root = next((line for line in lines if line.root and line.operands), None)
    return {line.name: line for line in lines}, root


def _unwrapped(line: _Line | None, by_name: dict[str, _Line]) -> _Line | None:
    """``line``, or what it copies, bitcasts or converts (through any chain of them)."""
    while line is not None and line.opcode in ("copy", "bitcast", "convert") and line.operands:
        line = by_name.get(line.operands[0])
    return line


def _tuple_index(line: _Line | None) -> int | None:
    """``k`` where ``line`` is ``get-tuple-element(..., index=k)``, else None."""
    if line is None or line.opcode != "get-tuple-element":
        return None
    index = re.search(r"index=(\d+)", line.attributes)
    return int(index.group(1)) if index else None


def _integer(constant: _Line) -> int:
    """The value of an integer scalar ``constant`` instruction (0 if it is none)."""
    return int(constant.literal) if re.fullmatch(r"-?\d+", constant.literal) else 0


def _called_work(computation: str, seen: set[str], module: _Module) -> tuple[set[str], float, bool]:
    """Opcodes, matmul FLOPs and SparseCore use of ``computation`` and what it calls (each
    computation once: ``seen``)."""
    kinds, flops, sparse = set(), 0.0, False
    for line in module.computations.get(computation, []):
        kinds.add(line.opcode)
        if line.opcode in ("dot", "convolution"):
            flops += _matmul_flops(line, module.types[computation])
        sparse |= "sparsecore" in line.attributes
        for called in _CALLED.findall(line.attributes):
            if called not in seen:
                seen.add(called)
                k, f, s = _called_work(called, seen, module)
                kinds, flops, sparse = kinds | k, flops + f, sparse or s
    return kinds, flops, sparse


def _op(line: _Line, computation: str, called: list[str], wrapped: bool, module: _Module) -> Op:
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
    counts = frozenset(math.prod(_dims(t)) for t in (line.result_type, *operand_types) if _dims(t))
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
    line: _Line, operand_types: list[str], called: list[str], module: _Module
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
        users: dict[str, list[_Line]] = collections.defaultdict(list)
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


def _bytes_read(name: str, users: dict[str, list[_Line]]) -> float:
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


def _bytes_written(line: _Line, by_name: dict[str, _Line]) -> float:
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


@dataclasses.dataclass
class Collective:
    """One collective of the schedule: its kind, the bytes it moves per device (the module
    docstring's definition), and the work the schedule places between its start and its done
    (0 ops when it is synchronous); ``trips``: how many times it runs per run of the module
    (``Op.trips``)."""

    kind: str
    bytes: float
    overlapped_ops: int
    overlapped_flops: float
    trips: int = 1


def _done(ops: list[Op], i: int) -> int:
    """Index of the ``-done`` completing the asynchronous start ``ops[i]`` (through any
    ``-update``), or ``i`` for a synchronous collective."""
    if not ops[i].opcode.endswith("-start"):
        return i
    chain = {ops[i].name}
    for j in range(i + 1, len(ops)):
        if chain.intersection(ops[j].operands):
            if ops[j].opcode.endswith("-done"):
                return j
            if ops[j].opcode.endswith("-update"):
                chain.add(ops[j].name)
    return i


def collectives(ops: list[Op]) -> list[Collective]:
    """The collectives of ``ops`` (``parse`` order = the entry schedule, then loop bodies),
    each once (an async pair by its start, a TPU chain by its first piece), with its bytes
    and the work scheduled between its start and its done (or its chain's last piece)."""
    found, chains = [], set()
    last = {op.collective_chain: j for j, op in enumerate(ops) if op.collective_chain}
    for i, op in enumerate(ops):
        if not op.collective or op.opcode.endswith(("-update", "-done")):
            continue
        if op.collective_chain:
            if op.collective_chain in chains:
                continue
            chains.add(op.collective_chain)
            done = last[op.collective_chain]
        else:
            done = _done(ops, i)
        between = [o for o in ops[i + 1 : done] if o.flops > 0 or o.cycles > 0]
        found.append(
            Collective(
                kind=op.collective,
                bytes=op.collective_bytes,
                overlapped_ops=len(between),
                overlapped_flops=sum(o.flops for o in between),
                trips=op.trips,
            )
        )
    return found


def collective_totals(ops: list[Op]) -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` of the ``collectives`` of ``ops`` per run of
    the module (one in a loop body counts once per trip), in ``COLLECTIVES`` order, kinds
    without any left out (bytes as whole bytes, per device)."""
    found = collectives(ops)
    totals = {}
    for kind in COLLECTIVES:
        of_kind = [c for c in found if c.kind == kind]
        if of_kind:
            totals[kind] = {
                "count": sum(c.trips for c in of_kind),
                "bytes": round(sum(c.bytes * c.trips for c in of_kind)),
            }
    return totals


# A scatter adding more updates than this per element it writes is contended: on a GPU its
# updates are atomic adds that serialise on the few addresses they share (3.1M updates into
# a 12 x 32 table took 1.45 s on an H100, an uncontended one of 16k rows 0.13 ms), and on a
# TPU they are a long serial accumulation. Gathers' gradients of small tables are the usual
# source; the fix is a one-hot contraction (a matmul) or a segment sum over sorted indices.
CONTENTION_LIMIT = 16.0


@dataclasses.dataclass(frozen=True)
class Scatter:
    """One ``scatter`` instruction of a module, fused or not.

    Attributes:
      name / computation: the instruction and the computation holding it.
      source: the JAX ``op_name`` of its metadata (of the fusion calling it when it has none).
      location: ``file:line`` of the Python source that made it ("" when the HLO has none).
      updates: elements of its (first) updates operand.
      written: elements of the (first) array it writes into.
    """

    name: str
    computation: str
    source: str
    location: str
    updates: int
    written: int

    @property
    def contention(self) -> float:
        """Updates per written element: how many adds meet at each address on average."""
        return self.updates / max(self.written, 1)

    def describe(self) -> str:
        """One line naming it: ``scatter.3 at relative_position.py:97 (jit(f)/...): 3,145,728
        updates into 384 elements (8192x)``."""
        where = f" at {self.location}" if self.location else ""
        return (
            f"{self.name}{where} ({self.source or 'no source'}): {self.updates:,} updates into "
            f"{self.written:,} elements ({self.contention:.0f}x)"
        )


def _source_lines(hlo_text: str) -> dict[str, str]:
    """``{stack frame id: "file:line"}`` from the module's ``FileNames`` / ``FileLocations``
    / ``StackFrames`` tables (how XLA prints source positions: an instruction's metadata
    names its innermost frame as ``stack_frame_id=N``)."""
    tables: dict[str, dict[str, str]] = {}
    table = None
    for text in hlo_text.splitlines():
        if text.startswith(("%", "ENTRY")):
            break
        if text in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = tables.setdefault(text, {})
        elif table is not None and text.strip():
            key, _, value = text.strip().partition(" ")
            table[key] = value
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    locations = {}
    for key, value in tables.get("FileLocations", {}).items():
        file, line = re.search(r"file_name_id=(\d+)", value), re.search(r"\bline=(\d+)", value)
        if file and line:
            locations[key] = f"{files.get(file.group(1), '?')}:{line.group(1)}"
    frames = {}
    for key, value in tables.get("StackFrames", {}).items():
        location = re.search(r"file_location_id=(\d+)", value)
        if location and location.group(1) in locations:
            frames[key] = locations[location.group(1)]
    return frames


def _metadata(attributes: str, source_lines: dict[str, str]) -> tuple[str, str]:
    """``(op_name, "file:line")`` of an instruction's metadata ("" where absent), the line
    from ``source_file`` / ``source_line`` or its ``stack_frame_id`` in ``source_lines``."""
    op_name = re.search(r'op_name="([^"]*)"', attributes)
    file = re.search(r'source_file="([^"]*)"', attributes)
    line = re.search(r"source_line=(\d+)", attributes)
    frame = re.search(r"stack_frame_id=(\d+)", attributes)
    location = (
        f"{file.group(1)}:{line.group(1)}"
        if file and line
        else source_lines.get(frame.group(1), "")
        if frame
        else ""
    )
    return (op_name.group(1) if op_name else "", location)


def scatters(hlo_text: str) -> list[Scatter]:
    """Every ``scatter`` of ``hlo_text`` (``compiled.as_text()``), in every computation.

    A scatter of N arrays has operands ``(arrays x N, indices, updates x N)``; the first
    array and the first updates operand give ``written`` and ``updates``."""
    computations, types, _ = _read(hlo_text)
    source_lines = _source_lines(hlo_text)
    caller = {
        called: line
        for lines in computations.values()
        for line in lines
        for called in _CALLED.findall(line.attributes)
    }
    found = []
    for computation, lines in computations.items():
        for line in lines:
            if line.opcode != "scatter" or len(line.operands) < 3:
                continue
            arrays = (len(line.operands) - 1) // 2
            source, location = _metadata(line.attributes, source_lines)
            if not source and computation in caller:
                source, location = _metadata(caller[computation].attributes, source_lines)
            shape = types[computation]
            found.append(
                Scatter(
                    name=line.name,
                    computation=computation,
                    source=source,
                    location=location,
                    updates=math.prod(_dims(shape.get(line.operands[arrays + 1], ""))),
                    written=math.prod(_dims(shape.get(line.operands[0], ""))),
                )
            )
    return found


def contended_scatters(hlo_text: str, limit: float = CONTENTION_LIMIT) -> list[Scatter]:
    """The ``scatters`` of ``hlo_text`` whose updates outnumber the elements they write by
    more than ``limit`` (``CONTENTION_LIMIT``), most contended first."""
    return sorted(
        (s for s in scatters(hlo_text) if s.contention > limit), key=lambda s: -s.contention
    )
