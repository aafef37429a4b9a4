"""The optimised (compiled) HLO module's text, read: its computations' instructions, their
result types, the bytes of array shapes, and how many times each computation runs.

:func:`read` gives every computation's instructions (:class:`Line`: name, result type,
opcode, operands, attributes) and their result types by name, and the entry computation;
:class:`Module` indexes them by computation and name. :func:`shape_bytes`: the bytes of the
arrays a type writes (``bf16[8,640,768]`` = 7.5 MiB), in every memory space or in device
memory only.

Loops: an instruction in a ``while`` body runs once per trip. :func:`run_counts` gives how many
times each computation runs per run of the module, the product of the trip counts of the
loops around it (``_trip_count``: XLA's ``known_trip_count`` on CPU and GPU; on TPU, which
prints none, read from the loop's condition, initial value and step). A loop whose trip
count cannot be read counts once.

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
CALLED = re.compile(r"\b(?:calls|body|condition|to_apply|branch_computations)=\{?%([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


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


def dims(text: str) -> list[int]:
    """Dimensions of the first array shape in ``text``."""
    match = _SHAPE.search(text)
    return [] if match is None else [int(d) for d in match.group(2).split(",") if d]


def _split_operands(rest: str) -> tuple[str, str]:
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return rest[: i - 1], rest[i:]


@dataclasses.dataclass(frozen=True)
class Line:
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


@dataclasses.dataclass(frozen=True)
class Module:
    """The computations of a module (``Line`` s by computation, and by name in each), the
    result types of each computation's instructions by name and, in each, the instruction
    that consumes each async start or update first."""

    computations: dict[str, list[Line]]
    by_name: dict[str, dict[str, Line]]
    consumer: dict[str, dict[str, Line]]
    types: dict[str, dict[str, str]]

    @classmethod
    def of(cls, computations: dict[str, list[Line]], types: dict[str, dict[str, str]]) -> Module:
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


def read(hlo_text: str) -> tuple[dict[str, list[Line]], dict[str, dict[str, str]], str]:
    """``(instructions by computation, result types by computation and name, entry name)``
    of ``hlo_text``."""
    computations: dict[str, list[Line]] = {}
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
                Line(
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


def run_counts(computations: dict[str, list[Line]], entry: str) -> dict[str, int]:
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
            for called in CALLED.findall(line.attributes):
                if called not in runs:
                    runs[called] = runs[computation] * trips
                    pending.append(called)
    return runs


def _trip_count(loop: Line, caller: dict[str, Line], computations: dict[str, list[Line]]) -> int:
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
    loop: Line, role: str, computations: dict[str, list[Line]]
) -> tuple[dict[str, Line], Line | None]:
    """The instructions by name of the ``role`` (``condition`` / ``body``) computation of the
    ``while`` instruction ``loop``, and its root when it has operands (else None)."""
    name = re.search(role + r"=%([\w.\-]+)", loop.attributes)
    lines = computations.get(name.group(1), []) if name else []
    root = next((line for line in lines if line.root and line.operands), None)
    return {line.name: line for line in lines}, root


def _unwrapped(line: Line | None, by_name: dict[str, Line]) -> Line | None:
    """``line``, or what it copies, bitcasts or converts (through any chain of them)."""
    while line is not None and line.opcode in ("copy", "bitcast", "convert") and line.operands:
        line = by_name.get(line.operands[0])
    return line


def _tuple_index(line: Line | None) -> int | None:
    """``k`` where ``line`` is ``get-tuple-element(..., index=k)``, else None."""
    if line is None or line.opcode != "get-tuple-element":
        return None
    index = re.search(r"index=(\d+)", line.attributes)
    return int(index.group(1)) if index else None


def _integer(constant: Line) -> int:
    """The value of an integer scalar ``constant`` instruction (0 if it is none)."""
    return int(constant.literal) if re.fullmatch(r"-?\d+", constant.literal) else 0
