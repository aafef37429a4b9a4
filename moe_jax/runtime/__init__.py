"""The training runtime: what the commands (`moe_jax.commands`) are built from.

Modules, one job each:
  gin_utils      command-line flags and gin parsing (files, `--gin.NAME=value`, bindings), the
                 run's recorded config and the gate that refuses code from a run directory
  distributed    `jax.distributed` start-up from flags/environment; preemption notices
  optimizers     optax optimizers and learning-rate schedules from gin
  model_protocol the Model protocol: what the runtime and the commands call on a model
  train_state    the train state pytree (step, params, optimizer state, RNG)
  builders       what every command builds the same way: mesh and rules, sharded state
                 layout, jitted steps, dataset configs, a restored model (reads no gin)
  configured     what gin chooses for a run (optimizer, router and bias modes), read for the
                 commands and passed to builders
  steps          the train and eval steps and their jitted step objects
  checkpoints    orbax checkpoint manager: async saves, restore onto any mesh, config checks
  run_lock       one trainer per run directory (`MODEL_DIR/LOCK`, a heartbeat lease)
  summaries      TensorBoard + JSON-lines metrics, progress bar, MFU, routing telemetry
  routing        per-token routing of every MoE layer of a restored model (the layer's opt-in
                 ``routing`` collection)
  evaluation     mean eval metrics over a dataset; the run's recorded eval settings
  run_names      how runs are named (``<family>/seed<N>``) and labelled (shortest distinct
                 path suffix) in every command
  scratch        a command's temporary files in a folder of its own, removed at its end
  aot            ahead-of-time compile for a TPU/GPU/CPU target: memory, fit, step time

Nothing here imports TensorFlow/seqio at import time.
"""
