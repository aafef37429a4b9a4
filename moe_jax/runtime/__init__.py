"""The training runtime: what the commands (`moe_jax.commands`) are built from.

Modules, one job each:
  gin_text       gin text read without running it: search paths, file text, inert parsing
  gin_flags      the T5X-style command-line flags (`--gin_file`, `--gin.NAME=value`, ...)
  gin_utils      gin parsing of the command line's files and bindings, errors naming the line
  config_gate    the gate refusing code named by a config from a run directory or an export
  run_config     the run's recorded gin config: kept, compared on resume, found by commands
  run_spec       the run as one typed value (`RunSpec`: model, data, loop, mesh, optimizer,
                 router and bias modes, seed), its exact JSON and its field-by-field diff
  run_record     the run's spec kept (`run.json` beside `config.gin`), compared field by
                 field on resume, read back by the commands for the run's model
  run_dir        the layout of a run directory: `RunDir` names every path in `MODEL_DIR`
  distributed    `jax.distributed` start-up from flags/environment; process-0 decisions;
                 objects gathered from every process; preemption notices
  optimizers     optax optimizers and learning-rate schedules from gin
  model_protocol the Model protocol: what the runtime and the commands call on a model
  train_state    the train state pytree (step, params, optimizer state, RNG)
  compute_copies the parameters' low-precision copies the train step reads and the update
                 writes (which ones: read from the loss's jaxpr)
  builders       what every command builds the same way: run context, sharded state
                 layout, jitted steps, dataset configs, a restored model (reads no gin)
  configured     the front door: registers every gin name users bind (the library imports
                 no gin); the `RunSpec` and what else gin chooses for a run (mesh and
                 rules, optimizer, router and bias modes), read once for the commands
  steps          the train and eval steps and their jitted step objects
  checkpoints    orbax checkpoints: async saves, keep-K, restores onto any mesh
  checkpoint_checks  whether a checkpoint step can be used: integrity record, parameter
                 shapes, finite parameters
  orbax_failures orbax's failures told in one line, its own reports of them dropped
  store_credentials  TensorStore's gs:// credentials opened once per process, without the
                 C++ log line naming them
  router_init    the routers' initial weights of a run (`router_init.npz`)
  run_lock       one trainer per run directory (`MODEL_DIR/LOCK`, a heartbeat lease)
  output_lock    one writer per output folder of `eval` / `export` (`FOLDER/.writing`)
  metrics        a run's metrics to TensorBoard, `metrics.jsonl` and W&B together; read
                 back; cut at a step on resume
  event_files    TensorBoard event files: written, framed as TFRecords, cut after a step
  throughput     steps/s, tokens/s and MFU against the devices' peak
  progress       a progress bar, or one timestamped line per logged step (`--progress`)
  routing_telemetry  per-MoE-layer load statistics (dead experts, imbalance, MaxVio) and
                 routing churn on a probe batch
  profiling      device traces of chosen steps (`train.profile_steps`); how busy a trace's
                 devices were
  wandb_logger   the same metrics to Weights & Biases when a project is set (lazy import)
  routing        per-token routing of every MoE layer of a restored model (the layer's opt-in
                 ``routing`` collection)
  evaluation     mean eval metrics over a dataset; the run's recorded eval settings
  run_names      how runs are named (``<family>/seed<N>``) and labelled (shortest distinct
                 path suffix) in every command
  scratch        a command's temporary files in a folder of its own, removed at its end
  background     start-up work on a background thread (a new run's data pipeline while its
                 step compiles), its result or its error handed to the thread that waits

Nothing here imports TensorFlow/seqio at import time.
"""
