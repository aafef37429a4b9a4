"""The collectives of a compiled step's schedule: the one count of collectives and their
bytes that ``moe-jax compile``'s report and the benchmarks use (:func:`collective_totals`),
read from the operations of :func:`moe_jax.compile.hlo_costs.parse`.

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

A collective in a loop body runs once per trip (``Op.trips``), and :func:`collective_totals`
counts it so.
"""

from __future__ import annotations

import dataclasses

from moe_jax.compile.hlo_costs import COLLECTIVES, Op


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
