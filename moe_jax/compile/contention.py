"""The contention guard: the scatters of a compiled step that add many updates into few
elements (:func:`contended_scatters`), which a roofline cannot see: on a GPU such a
scatter's atomic adds serialise.
"""

from __future__ import annotations

import dataclasses
import math
import re

from moe_jax.compile.hlo_text import CALLED, dims, read

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
    computations, types, _ = read(hlo_text)
    source_lines = _source_lines(hlo_text)
    caller = {
        called: line
        for lines in computations.values()
        for line in lines
        for called in CALLED.findall(line.attributes)
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
                    updates=math.prod(dims(shape.get(line.operands[arrays + 1], ""))),
                    written=math.prod(dims(shape.get(line.operands[0], ""))),
                )
            )
    return found


def contended_scatters(hlo_text: str, limit: float = CONTENTION_LIMIT) -> list[Scatter]:
    """The ``scatters`` of ``hlo_text`` whose updates outnumber the elements they write by
    more than ``limit`` (``CONTENTION_LIMIT``), most contended first."""
    return sorted(
        (s for s in scatters(hlo_text) if s.contention > limit), key=lambda s: -s.contention
    )
