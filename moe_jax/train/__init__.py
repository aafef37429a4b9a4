"""T5X-style binaries: `moe-jax train`, `moe-jax eval`, `moe-jax infer`.

Modules, one job each:
  gin_utils      command-line flags and gin parsing (files, `--gin.NAME=value`, bindings)
  distributed    `jax.distributed` start-up from flags/environment; preemption notices
  optimizers     optax optimizers and learning-rate schedules from gin
  train_state    the train state pytree (step, params, optimizer state, RNG)
  setup          what train, eval, infer, analyze and compile share: mesh, optimizer,
                 sharded state layout, jitted steps, dataset configs
  train_step     the jitted train and eval steps
  checkpoints    orbax checkpoint manager: async saves, restore onto any mesh, config checks
  summaries      TensorBoard + JSON-lines metrics, progress bar, MFU
  train          the training loop (`moe-jax train`)
  evaluate       checkpoint evaluation and comparison tables (`moe-jax eval`)
  infer          decoding from a checkpoint (`moe-jax infer`)

Nothing here imports TensorFlow/seqio at import time.
"""
