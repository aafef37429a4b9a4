"""T5X-style binaries: `moe-jax train`, `eval`, `infer`, `compile`, `export`, `import`,
`upcycle`, `sweep`.

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
  aot            ahead-of-time compile for a TPU/GPU/CPU target: memory, fit, step time
                 (`moe-jax compile`; `train` checks the fit with it before its first step)
  run_lock       one trainer per run directory (`MODEL_DIR/LOCK`, a heartbeat lease)
  export         checkpoint <-> safetensors + JSON config (`moe-jax export` / `import`)
  upcycle        an MoE run from a dense run's checkpoint (`moe-jax upcycle`)
  sweep          experiment families: expand into runs, collect eval curves (`moe-jax sweep`)
  routing_comparison  the last-eval table and bar chart of a routing sweep family
  __main__       `python -m moe_jax.train` = `moe-jax train`

Nothing here imports TensorFlow/seqio at import time.
"""
