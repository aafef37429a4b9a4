"""Compiling a run ahead of time for a TPU, GPU or CPU target, and reading what the compiler
made of it: what `moe-jax compile` (:mod:`moe_jax.commands.compile`), `moe-jax train`'s fit
check and the compiled benchmarks are built from.

Modules, one job each:
  targets        what ``--target`` names (``tpu:v5p:2x2x4``, ``gpu:h100:8``, ``cpu:8``) and
                 its devices, from the TPU/GPU compilers outside the import path
                 (``gpu_specs/``: the GPUs' descriptions)
  aot            the run's train and eval steps compiled for a target's devices: the
                 report, `train`'s fit check, what to change when a run does not fit
  step_analysis  one compiled step per device: memory and fit, collectives, the MoE
                 layers' share, a roofline estimate of step time
  report         the compile report as printed
  hlo_text       the optimised HLO text read: instructions, array bytes, loop trip counts
  hlo_costs      per-operation costs of the HLO: bytes moved, matmul FLOPs, TPU cycle
                 estimates, totals by part of the model
  collectives    the collectives of the schedule, each once, with the bytes it moves
  contention     the contention guard: scatters adding many updates into few elements

Chip facts (HBM, peak FLOP/s, bandwidths) are :mod:`moe_jax.hardware`'s, which the runtime
shares.
"""
