"""The `moe-jax` command binaries (T5X-style: gin files and `--gin.NAME=value` flags).

Each module's ``main(argv)`` is one command of :mod:`moe_jax.cli`:
  train      `moe-jax train`: the training loop
  evaluate   `moe-jax eval`: checkpoint evaluation and comparison tables
  infer      `moe-jax infer`: decoding from a checkpoint
  compile    `moe-jax compile`: compile a run for its TPU/GPU/CPU target, report memory
             and fit (:mod:`moe_jax.compile`)
  export     `moe-jax export`: a checkpoint as safetensors + JSON config (or a Hugging Face
             folder)
  import_run `moe-jax import`: an export or a Hugging Face folder as a new run directory
  upcycle    `moe-jax upcycle`: an MoE run from a dense run's checkpoint
  analyze    `moe-jax analyze`: routing analyses over checkpoints (:mod:`moe_jax.analysis`)

  subcommands  picking a subcommand from a command line (shared with :mod:`moe_jax.cli`)

They are built from :mod:`moe_jax.runtime`, :mod:`moe_jax.compile`, :mod:`moe_jax.analysis`
and :mod:`moe_jax.interop`; none imports another
command's module or anything in :mod:`moe_jax.experiments`.
"""
