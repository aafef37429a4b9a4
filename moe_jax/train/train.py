"""`moe-jax train`: T5X-style gin-configured training (also `python -m moe_jax.train`).

    moe-jax train --gin_file=models/t5_moe.gin --gin_file=runs/pretrain.gin \\
        --gin.MODEL_DIR=/tmp/run --gin.TRAIN_STEPS=1000

The loop: restore the latest checkpoint of ``MODEL_DIR`` (state, step, data-iterator
position, RNG) or initialise; then per step fetch this host's batch shard, run the jitted
train step (state donated), check the loss, log, save every ``checkpoint_period`` steps
(async), evaluate every ``eval_period`` steps. SIGTERM saves a checkpoint and exits 143;
a non-finite loss stops with the step and the last good checkpoint (or, with
``train.on_nonfinite = 'skip'``, drops that step's update).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import gin
import jax
import numpy as np

from moe_jax.train import distributed, gin_utils, setup

EXIT_PREEMPTED = 143  # 128 + SIGTERM, as a shell reports a terminated process


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN/Inf; the message names the step and the last good checkpoint."""


def make_iterator(cfg: setup.DatasetConfig, *, state: dict | None = None, start_step: int = 0):
    """This process's resumable stream of training batches (``[batch / processes, length]``
    numpy arrays); ``state`` (from ``get_state()``) continues a saved position exactly,
    ``start_step`` skips that many batches of a fresh stream."""
    from moe_jax.data import pipeline

    if state is not None:
        return pipeline.TrainIterator.restore(state)
    if cfg.batch_size % jax.process_count():
        raise ValueError(f"DatasetConfig.batch_size={cfg.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")
    return pipeline.TrainIterator(
        cfg.mixture_or_task_name, dict(cfg.task_feature_lengths),
        batch_size=cfg.batch_size // jax.process_count(), seed=cfg.seed, split=cfg.split,
        pack=cfg.pack, use_cached=cfg.use_cached, start_step=start_step)


@gin.configurable(module="train_script", denylist=["stop_after_steps"])
def train(
    *,
    model: Any = gin.REQUIRED,
    train_dataset_cfg: setup.DatasetConfig = gin.REQUIRED,
    train_eval_dataset_cfg: setup.DatasetConfig | None = None,
    model_dir: str = gin.REQUIRED,
    total_steps: int = gin.REQUIRED,
    random_seed: int = 0,
    checkpoint_period: int = 1000,
    keep_checkpoints: int | None = 3,
    async_checkpointing: bool = True,
    log_period: int = 100,
    eval_period: int = 0,
    eval_steps: int = 10,
    accum_steps: int = 1,
    on_nonfinite: str = "stop",
    stop_after_steps: int | None = None,
) -> dict[str, Any]:
    """Trains ``model`` to ``total_steps``, resuming from ``model_dir``'s latest checkpoint.

    Args:
      checkpoint_period: save every N steps (and at the end); keep the last
        ``keep_checkpoints``.
      log_period: write the logged step's train metrics and the throughput since the last
        log every N steps.
      eval_period: evaluate ``eval_steps`` batches of ``train_eval_dataset_cfg`` every N steps
        (0: never).
      accum_steps: gradient accumulation microbatches per step.
      on_nonfinite: ``'stop'`` (raise naming the step and last good checkpoint) or ``'skip'``.
      stop_after_steps: end (with a checkpoint) after this many steps of *this* invocation
        (tests of interrupted runs); not a gin parameter.

    Returns:
      ``{"step", "losses": {step: loss}, "last_checkpoint", "preempted", "model_dir", "wall_sec"}``.
    """
    from moe_jax.train import checkpoints, evaluate, summaries

    if on_nonfinite not in ("stop", "skip"):
        raise ValueError(f"train.on_nonfinite={on_nonfinite!r}; expected 'stop' or 'skip'")
    checkpoints.ensure_writable(model_dir)
    ctx = setup.run_context()
    input_shapes = train_dataset_cfg.input_shapes()
    run = setup.build_train_setup(model, input_shapes, ctx, seed=random_seed, accum_steps=accum_steps,
                                  skip_nonfinite=on_nonfinite == "skip")
    ckpt = checkpoints.Checkpointer(model_dir, save_period=checkpoint_period, keep=keep_checkpoints,
                                    async_save=async_checkpointing)
    latest = ckpt.latest_step()
    if latest is None:
        state = run.init_state()
        iterator = make_iterator(train_dataset_cfg)
        checkpoints.save_router_init(model_dir, state.params)
    else:
        state, meta = ckpt.restore(latest, run.abstract_state)
        saved = meta["data_iterators"]
        if len(saved) == jax.process_count():
            iterator = make_iterator(train_dataset_cfg, state=saved[jax.process_index()])
        else:  # another process count: same position, this run's sharding of the stream
            iterator = make_iterator(train_dataset_cfg, start_step=latest)
        _log(f"restored {ckpt.directory}/{latest}")
    if jax.process_index() == 0:
        with open(os.path.join(model_dir, "config.gin"), "w") as f:
            f.write(gin_utils.operative_config())
    _log(f"{model.num_params(state.params):,} parameters; mesh {dict(ctx.mesh.shape)}; "
         f"{jax.process_count()} process(es), {jax.device_count()} devices")

    step_fn = run.train_step
    eval_fn = run.eval_step if train_eval_dataset_cfg is not None and eval_period else None
    writer = summaries.MetricsWriter(model_dir, "train")
    eval_writer = summaries.MetricsWriter(model_dir, "eval") if eval_fn else None
    tokens_per_step = int(np.prod(input_shapes["decoder_input_tokens"]) +
                          np.prod(input_shapes["encoder_input_tokens"]))
    meter = summaries.ThroughputMeter(model.flops_per_step(input_shapes), tokens_per_step,
                                      summaries.peak_flops_per_device() * jax.device_count())
    preemption = distributed.PreemptionWatcher()

    step = int(jax.device_get(state.step))
    end = total_steps if stop_after_steps is None else min(total_steps, step + stop_after_steps)
    last_saved = latest
    losses: dict[int, float] = {}
    preempted = False
    bar = summaries.progress_bar(step, total_steps)
    start_time = time.perf_counter()
    try:
        batch = setup.global_batch(next(iterator), ctx)
        while step < end:
            state, metrics = step_fn(state, batch)            # async dispatch; state donated
            data_state = iterator.get_state()                 # position after this step's batch
            if step + 1 < end:
                batch = setup.global_batch(next(iterator), ctx)     # overlaps the device's step
            metrics = jax.device_get(metrics)
            step += 1
            meter.tick()
            bar.update(1)
            loss = float(metrics["loss"])
            losses[step] = loss
            if not np.isfinite(loss) and on_nonfinite == "stop":
                raise NonFiniteLossError(
                    f"loss is {loss} at step {step}; last good checkpoint: "
                    f"{_checkpoint_name(ckpt, last_saved)}. Restarting resumes from it; bind "
                    "train.on_nonfinite='skip' to skip such steps instead.")
            if step % log_period == 0 or step == end:
                rates = meter.rates()
                writer.write(step, {**metrics, **rates})
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rates['tokens_per_sec']:.0f}")
            preempted = preemption.reached(step)
            if ckpt.should_save(step) or step == end or preempted:
                meta = {"data_iterators": checkpoints.gather_from_processes(data_state),
                        "random_seed": random_seed}
                if ckpt.save(state, meta, force=True):
                    last_saved = step
            if preempted:
                _log(f"SIGTERM: saved a checkpoint at step {step}; exiting")
                break
            if eval_fn and step % eval_period == 0:
                eval_metrics = evaluate.run_eval(eval_fn, state.params, train_eval_dataset_cfg,
                                                 ctx, eval_steps, state.collections)
                eval_writer.write(step, eval_metrics)
                bar.write(f"step {step}: eval loss {eval_metrics['loss']:.4f} "
                          f"accuracy {eval_metrics['accuracy']:.4f}")
    finally:
        iterator.close()
        bar.close()
        ckpt.wait_until_finished()
        ckpt.close()
        writer.close()
        if eval_writer:
            eval_writer.close()
        preemption.close()
    elapsed = time.perf_counter() - start_time
    return {"step": step, "losses": losses, "preempted": preempted, "model_dir": model_dir,
            "last_checkpoint": _checkpoint_name(ckpt, last_saved), "wall_sec": elapsed}


def _checkpoint_name(ckpt, step: int | None) -> str:
    return "none yet" if step is None else f"{ckpt.directory}/{step}"


def _log(message: str) -> None:
    if jax.process_index() == 0:
        print(f"[moe-jax] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = setup.build_parser("moe-jax train", __doc__.splitlines()[0])
    args = gin_utils.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    try:
        distributed.initialize(args)
        gin_utils.parse_gin(args)
        result = train()
    except (gin_utils.GinConfigError, PermissionError, NonFiniteLossError, ValueError) as err:
        print(f"moe-jax train: error: {err}", file=sys.stderr)
        return 1
    return EXIT_PREEMPTED if result["preempted"] else 0
