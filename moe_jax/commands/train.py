"""`moe-jax train`: T5X-style gin-configured training (also `python -m moe_jax.train`).

    moe-jax train --gin_file=models/t5_moe.gin --gin_file=runs/pretrain.gin \\
        --gin.MODEL_DIR=/tmp/run --gin.TRAIN_STEPS=1000

The loop: restore the latest checkpoint of ``MODEL_DIR`` (state, step, data-iterator
position, RNG) or initialise; then per step fetch this host's batch shard, run the jitted
train step (state donated), check the *previous* step's loss (so the host never waits for
the step it just dispatched), log, save every ``checkpoint_period`` steps (async),
evaluate every ``eval_period`` steps and at the last step. Steps that log, save or
evaluate check their own loss first and fetch the metrics; no other step fetches more than
its loss. SIGTERM or Ctrl-C ends the step, saves a checkpoint and exits 143 / 130 with
one line naming it (a second Ctrl-C stops without waiting for the step, naming the last
finished checkpoint); a non-finite loss stops with its step and the last good checkpoint (or, with
``train.on_nonfinite = 'skip'``, drops that step's update).

Faults (docs/training.md, "Reliability"): one trainer per ``MODEL_DIR`` (``run_lock``);
an unreadable latest checkpoint is moved aside and the newest readable one used; a failed
write anywhere in ``MODEL_DIR`` (a checkpoint, ``metrics.jsonl``, TensorBoard, configs)
stops the run (exit 74) naming the file and the last good checkpoint; a resumption whose gin
config differs from the run's (``config.gin``, or the newest ``config.step-N.gin`` an
accepted change wrote) is refused unless ``--allow_config_change``, and an accepted data
change is applied (the stream restarts at the resumed step); parameters holding NaN/Inf are
never saved; a start refused before its first checkpoint leaves no ``MODEL_DIR``;
``metrics.jsonl`` and TensorBoard records past the restored step are dropped on resume.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import errors, partitioning, storage
from moe_jax.runtime import (
    aot,
    builders,
    checkpoints,
    configured,
    distributed,
    evaluation,
    gin_utils,
    run_lock,
    summaries,
)
from moe_jax.runtime.model_protocol import Model


class NonFiniteLossError(errors.UserError, FloatingPointError):
    """The loss became NaN/Inf; the message names the step and the last good checkpoint."""

    exit_code = errors.EXIT_NONFINITE


def make_iterator(cfg: builders.DatasetConfig, *, state: dict | None = None, start_step: int = 0):
    """This process's resumable stream of training batches (``[batch / processes, length]``
    numpy arrays); ``state`` (from ``get_state()``) continues a saved position exactly,
    ``start_step`` skips that many batches of a fresh stream."""
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import pipeline

    if state is not None:
        return pipeline.TrainIterator.restore(state)
    return pipeline.TrainIterator(
        cfg.mixture_or_task_name,
        dict(cfg.task_feature_lengths),
        batch_size=partitioning.per_process_batch_size(cfg.batch_size),
        seed=cfg.seed,
        split=cfg.split,
        pack=cfg.pack,
        use_cached=cfg.use_cached,
        start_step=start_step,
    )


def stream_changes(saved: dict[str, Any], cfg: builders.DatasetConfig) -> list[str]:
    """How this process's stream of ``cfg`` differs from a saved iterator state (task,
    split, feature lengths, per-process batch size, seed, packing, cache), as
    ``"name: saved -> now"``; empty when the saved position continues the same stream."""
    now = {
        "mixture_or_task_name": cfg.mixture_or_task_name,
        "split": cfg.split,
        "task_feature_lengths": dict(cfg.task_feature_lengths),
        "batch_size": partitioning.per_process_batch_size(cfg.batch_size),
        "seed": cfg.seed,
        "pack": cfg.pack,
        "use_cached": cfg.use_cached,
    }
    return [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v]


def _resumed_iterator(
    cfg: builders.DatasetConfig, meta: dict[str, Any] | None, latest: int | None
) -> tuple[Any, str | None]:
    """The training stream and, when it restarts, why: fresh at step 0; a restored run
    continues its saved position when the stream is the one it saved, else (another process
    count, or a data change accepted with ``--allow_config_change``) reads ``cfg``'s stream
    from batch ``latest``. Built before the run's config is recorded: building it calls the
    data configurables, which the recorded config must hold."""
    if meta is None or latest is None:
        return make_iterator(cfg), None
    saved = meta["data_iterators"]
    if len(saved) != jax.process_count():  # same position, this run's sharding of the stream
        return make_iterator(cfg, start_step=latest), None
    changes = stream_changes(saved[jax.process_index()], cfg)
    if not changes:
        return make_iterator(cfg, state=saved[jax.process_index()]), None
    return make_iterator(cfg, start_step=latest), (
        f"the training data changed at step {latest} ({'; '.join(changes)}): reading the new "
        f"stream from its batch {latest}"
    )


@gin.configurable(
    module="train_script",
    denylist=["stop_after_steps", "allow_config_change", "command_line_bindings", "progress"],
)
def train(
    *,
    model: Model = gin.REQUIRED,
    train_dataset_cfg: builders.DatasetConfig = gin.REQUIRED,
    train_eval_dataset_cfg: builders.DatasetConfig | None = None,
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
    sync_every_step: bool = False,
    routing_churn: bool = True,
    stop_after_steps: int | None = None,
    allow_config_change: bool = False,
    command_line_bindings: Sequence[str] = (),
    progress: str = "auto",
) -> dict[str, Any]:
    """Trains ``model`` to ``total_steps``, resuming from ``model_dir``'s latest checkpoint.

    Args:
      checkpoint_period: save every N steps and at the end (only those: no step-1
        checkpoint); keep the last ``keep_checkpoints``.
      log_period: write the logged step's train metrics and the throughput since the last
        log every N steps.
      eval_period: evaluate ``eval_steps`` batches of ``train_eval_dataset_cfg`` every N steps
        and at the final step ``total_steps``, as T5X does (0: never).
      accum_steps: gradient accumulation microbatches per step.
      on_nonfinite: ``'stop'`` (raise naming the step and last good checkpoint) or ``'skip'``.
        The loss is checked one step late, so a stop comes with the next step already
        dispatched (never saved: a checkpoint is written only after its step's loss is
        checked).
      sync_every_step: fetch every step's metrics and check its loss before dispatching
        the next step (a synchronous loop: the device idles while the host works;
        for debugging and as the baseline of ``benchmarks/train_loop.py``).
      routing_churn: at each evaluation, also route the first eval batch and log per MoE
        layer the fraction of its tokens whose top-1 expert changed since the previous
        evaluation (``summaries.ChurnProbe``).
      stop_after_steps: end (with a checkpoint) after this many steps of *this* invocation
        (tests of interrupted runs); not a gin parameter.
      allow_config_change: resume although the operative gin config differs from the run's
        config as last accepted (``--allow_config_change``; kept as ``config.step-N.gin``,
        which later resumptions compare with).
      command_line_bindings: the command line's gin binding lines; one binding a model
        config the built model never reads is refused (not a gin parameter).
      progress: ``'bar'`` (a progress bar), ``'lines'`` (a timestamped line per logged step
        and evaluation) or ``'auto'``: the bar where stderr is a terminal, else lines
        (``--progress``; :class:`~moe_jax.runtime.summaries.Progress`).

    Returns:
      ``{"step", "losses": {step: loss}, "last_checkpoint", "preempted", "signal", "model_dir",
      "wall_sec"}``; ``preempted``: stopped early by SIGTERM or Ctrl-C (``signal``, its
      number) after saving ``last_checkpoint``.

    Raises:
      WriteFailedError: a write to ``model_dir`` failed; names the file and the last good
        checkpoint.
      Interrupted: a second Ctrl-C (or one before the training loop) stopped the run before
        a checkpoint was saved; names the last checkpoint.
    """
    if on_nonfinite not in ("stop", "skip"):
        raise errors.ConfigError(f"train.on_nonfinite={on_nonfinite!r}; expected 'stop' or 'skip'")
    model_dir = storage.normalize(model_dir)
    _check_total_steps(total_steps, checkpoints.reached_step(model_dir), model_dir)
    with _holding(model_dir):
        model.check_vocabulary()
        ctx = builders.run_context()
        input_shapes = train_dataset_cfg.input_shapes()
        run = configured.train_setup(
            model,
            input_shapes,
            ctx,
            seed=random_seed,
            accum_steps=accum_steps,
            skip_nonfinite=on_nonfinite == "skip",
        )
        _refuse_unread_bindings(command_line_bindings)
        _log("compiling the train step (and checking that it fits)")
        step_fn = aot.check_fits(run, train_dataset_cfg, model)  # before any state exists
        ckpt = checkpoints.Checkpointer(
            model_dir,
            save_period=checkpoint_period,
            keep=keep_checkpoints,
            async_save=async_checkpointing,
            remove_partial_saves=True,
        )
        set_aside = checkpoints.set_aside_steps(model_dir)  # at earlier starts
        restored = checkpoints.restore_latest_readable(ckpt, run.abstract_state, _log)
        _check_set_aside(model_dir, set_aside, fresh=restored is None)
        if restored is None:
            latest, meta = None, None
            _log("initialising the parameters and optimizer state")
            state = run.init_state()
            checkpoints.save_router_init(model_dir, state.params)
        else:
            state, meta, latest = restored
            _check_random_seed(meta, random_seed, ckpt.name(latest))
            _log(f"restored {ckpt.directory}/{latest}")
        _log("starting the data pipeline")
        iterator, restart = _resumed_iterator(train_dataset_cfg, meta, latest)
        distributed.process_zero_decides(
            lambda: gin_utils.record_run_config(
                model_dir,
                gin_utils.operative_config(),
                latest or 0,
                allow_change=allow_config_change,
            ),
            lambda: errors.UserError("refused on process 0 (see its message)"),
        )
        if restart:  # said once the change is accepted
            _log(restart)
        if jax.process_index() == 0:
            summaries.drop_records_after(model_dir, latest or 0)
            if (
                train_eval_dataset_cfg is not None
            ):  # for `moe-jax eval` to reproduce this run's evaluation
                evaluation.record_eval_settings(model_dir, eval_steps, train_eval_dataset_cfg)
        _log(
            f"{model.num_params(state.params):,} parameters; mesh {dict(ctx.mesh.shape)}; "
            f"{jax.process_count()} process(es), {jax.device_count()} devices"
        )

        eval_fn = (
            run.jitted_eval_step if train_eval_dataset_cfg is not None and eval_period else None
        )
        expert_shards = int(dict(ctx.mesh.shape).get("expert", 1))
        writer = summaries.MetricsWriter(model_dir, expert_shards)
        churn: summaries.ChurnProbe | None = (
            None  # built at the first evaluation, not before step 1
        )
        with_churn = bool(eval_fn) and routing_churn and train_eval_dataset_cfg is not None
        tokens_per_step = int(
            np.prod(input_shapes["decoder_input_tokens"])
            + np.prod(input_shapes["encoder_input_tokens"])
        )
        meter = summaries.ThroughputMeter(
            model.flops_per_step(input_shapes),
            tokens_per_step,
            summaries.peak_flops_per_device() * jax.device_count(),
        )
        preemption = distributed.PreemptionWatcher()

        step = first_step = int(jax.device_get(state.step))
        end = total_steps if stop_after_steps is None else min(total_steps, step + stop_after_steps)
        last_saved = latest
        losses: dict[int, float] = {}
        preempted = False
        ticker = summaries.Progress(step, total_steps, progress)
        start_time = time.perf_counter()

        def check_loss(checked_step: int, step_metrics) -> float:
            """Fetches one step's loss (a scalar) and stops on NaN/Inf when asked to."""
            loss = float(step_metrics["loss"])
            losses[checked_step] = loss
            if not np.isfinite(loss) and on_nonfinite == "stop":
                raise NonFiniteLossError(
                    f"loss is {loss} at step {checked_step}; last good checkpoint: "
                    f"{ckpt.name(last_saved)}. Restarting resumes from it; bind "
                    "train.on_nonfinite='skip' to skip such steps instead."
                )
            return loss

        unchecked = None  # (step, its metrics still on the device) whose loss is not yet read
        try:
            batch = builders.global_batch(builders.first_batch(iterator, train_dataset_cfg), ctx)
            while step < end:
                state, metrics = step_fn(state, batch)  # async dispatch; state donated
                if step == first_step:  # said once, when it is done: the run is under way
                    ticker.write(f"step {step + 1} done: loss {float(metrics['loss']):.4f}")
                data_state = iterator.get_state()  # position after this step's batch
                if step + 1 < end:
                    batch = builders.global_batch(next(iterator), ctx)  # overlaps the device's step
                if sync_every_step:
                    metrics = jax.device_get(metrics)
                ckpt.check_for_errors()  # a failed background save stops here
                step += 1
                meter.tick()
                ticker.update()
                if unchecked is not None:  # the previous step: done, or queued just before this one
                    check_loss(*unchecked)
                unchecked = (step, metrics)
                preempted = preemption.reached(step)
                log_now = step % log_period == 0 or step == end
                save_now = step % checkpoint_period == 0 or step == end or preempted
                eval_now = bool(eval_fn) and (step % eval_period == 0 or step == total_steps)
                if not (sync_every_step or log_now or save_now or eval_now):
                    continue
                loss = check_loss(*unchecked)  # waits for this step
                unchecked = None
                if log_now:
                    rates = meter.rates()
                    writer.write("train", step, {**jax.device_get(metrics), **rates})
                    ticker.log(step, loss, rates["tokens_per_sec"])
                if save_now:
                    _check_parameters(state.params, step, ckpt.name(last_saved))
                    meta = {
                        "data_iterators": checkpoints.gather_from_processes(data_state),
                        "random_seed": random_seed,
                    }
                    if ckpt.save(state, meta, force=True):
                        last_saved = step
                    writer.flush()
                if preempted:
                    break
                if eval_now:
                    eval_metrics = evaluation.run_eval(
                        eval_fn,
                        state.params,
                        train_eval_dataset_cfg,
                        ctx,
                        eval_steps,
                        state.collections,
                    )
                    if with_churn:
                        churn = churn or _churn_probe(
                            model, run, ctx, train_eval_dataset_cfg, model_dir
                        )
                        eval_metrics.update(churn(state.params, state.collections))
                    writer.write("eval", step, eval_metrics)
                    ticker.write(
                        f"step {step}: eval loss {eval_metrics['loss']:.4f} "
                        f"accuracy {eval_metrics['accuracy']:.4f}"
                    )
        finally:
            iterator.close()
            ticker.close()
            ckpt.wait_until_finished()
            ckpt.close()
            writer.close()
            preemption.close()
        elapsed = time.perf_counter() - start_time
        return {
            "step": step,
            "losses": losses,
            "preempted": preempted,
            "signal": preemption.signum,
            "model_dir": model_dir,
            "last_checkpoint": ckpt.name(last_saved),
            "wall_sec": elapsed,
        }


def _refuse_unread_bindings(bindings: Sequence[str]) -> None:
    """Refuses those of ``bindings`` (the command line's) that bind a model config the built
    model never read.

    Raises:
      ConfigError: naming them.
    """
    unread = gin_utils.unread_model_bindings(bindings)
    if unread:
        raise errors.ConfigError(
            f"{'; '.join(unread)}: no part of the model reads "
            f"{'this binding' if len(unread) == 1 else 'these bindings'} (a config of a router "
            "or layer the model does not use?)"
        )


@contextlib.contextmanager
def _holding(model_dir: str) -> Iterator[None]:
    """Holds ``model_dir``'s lock for the block. A failed write or an interrupt that stopped
    it without saving names the last checkpoint; a run refused before its first checkpoint
    (vocabulary, experts, mesh, data) leaves no ``MODEL_DIR`` behind when it created it."""
    created = not storage.exists(model_dir)
    checkpoints.ensure_writable(model_dir)
    try:
        with run_lock.hold(model_dir), _naming_last_checkpoint(model_dir):
            yield
    except Exception as err:
        refused = not isinstance(err, NonFiniteLossError | errors.WriteFailedError)
        if (
            created
            and refused
            and jax.process_index() == 0
            and checkpoints.reached_step(model_dir) is None
        ):
            storage.rmtree(model_dir)
        raise


@contextlib.contextmanager
def _naming_last_checkpoint(model_dir: str) -> Iterator[None]:
    """Adds the run's last checkpoint (and how to resume) to a failed write and an
    interrupt that stopped the block without saving."""
    try:
        yield
    except errors.WriteFailedError as err:
        if err.names_last_good:
            raise
        raise errors.WriteFailedError(
            f"{err}; last good checkpoint: {_last_checkpoint(model_dir)}", names_last_good=True
        ) from err
    except KeyboardInterrupt as err:
        if isinstance(err, errors.Interrupted) and err.detail:
            raise
        latest = _last_checkpoint(model_dir)
        then = (
            "no checkpoint yet: the same command starts the run again"
            if latest == "none yet"
            else f"last checkpoint: {latest}; the same command resumes from it"
        )
        raise errors.Interrupted(
            getattr(err, "signum", signal.SIGINT), f"nothing saved at this stop; {then}"
        ) from None


def _last_checkpoint(model_dir: str) -> str:
    """``MODEL_DIR/checkpoints/STEP`` of the newest finished checkpoint, or ``"none yet"``."""
    step = checkpoints.reached_step(model_dir)
    return "none yet" if step is None else storage.join(model_dir, "checkpoints", str(step))


def _churn_probe(model, run, ctx, eval_cfg, model_dir: str) -> summaries.ChurnProbe:
    """The routing-churn probe of a run: the first eval batch is its fixed probe batch."""
    probe_batch = next(builders.eval_batches(eval_cfg, 1))
    return summaries.ChurnProbe(
        model, run.shardings.params, ctx, probe_batch, model_dir, run.shardings.collections
    )


def _check_total_steps(total_steps: Any, reached: int | None, model_dir: str) -> None:
    """Refuses a ``TRAIN_STEPS`` that is not a positive integer or is below the step the
    run already reached (before anything is written)."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
        raise errors.ConfigError(
            f"TRAIN_STEPS (train_script.train.total_steps) = {total_steps!r}; "
            "expected a positive integer"
        )
    if reached is not None and total_steps < reached:
        raise errors.ConfigError(
            f"TRAIN_STEPS={total_steps} is below step {reached}, which MODEL_DIR={model_dir} "
            f"already reached; pass TRAIN_STEPS >= {reached} to continue it, or another MODEL_DIR"
        )


def _check_parameters(params: Any, step: int, last_saved: str) -> None:
    """Stops before saving parameters that hold NaN or Inf (a finite loss came before the
    update that broke them): every checkpoint of a run has finite parameters.

    Raises:
      NonFiniteLossError: naming the step, a parameter and the last good checkpoint.
    """
    bad = checkpoints.nonfinite_parameters(params)
    if bad:
        raise NonFiniteLossError(
            f"parameters hold NaN or Inf after step {step} ({bad[0]}, {len(bad)} in all); "
            f"not saved; last good checkpoint: {last_saved}"
        )


def _check_random_seed(meta: dict[str, Any], random_seed: int, checkpoint: str) -> None:
    """Refuses another ``random_seed`` on resume: the RNG state (dropout, and the parameters
    it initialised) comes from the checkpoint, so no resumed run can apply it."""
    saved = meta.get("random_seed", random_seed)
    if saved != random_seed:
        raise errors.ConfigError(
            f"RANDOM_SEED (train_script.train.random_seed) = {random_seed}, but {checkpoint} was "
            f"trained with {saved}: a resumed run keeps its checkpoint's RNG state, so it cannot "
            "apply another seed; start a new MODEL_DIR for it"
        )


def _check_set_aside(model_dir: str, aside: list[int], *, fresh: bool) -> None:
    """Names the damaged checkpoints set aside at earlier starts (at every start until they
    are deleted), and refuses to train from step 0 while they are there."""
    if not aside:
        return
    folder = storage.join(model_dir, checkpoints.UNREADABLE_DIR)
    if fresh:
        raise errors.CheckpointError(
            f"MODEL_DIR={model_dir} has no readable checkpoint, but {folder} holds step(s) {aside} "
            "set aside as damaged: refusing to train again from step 0. Inspect them; delete that "
            "folder to start afresh."
        )
    _log(f"warning: {folder} holds step(s) {aside} set aside as damaged (delete it once inspected)")


def _log(message: str) -> None:
    if jax.process_index() == 0:
        print(f"[moe-jax] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Exit code 0; expected errors and interrupts are raised for :func:`moe_jax.cli.main`
    to report (codes in :mod:`moe_jax.errors`)."""
    parser = builders.build_parser("moe-jax train", __doc__.splitlines()[0])
    parser.add_argument(
        "--allow_config_change",
        action="store_true",
        help="resume although the gin config differs from the run's (config.gin "
        "or the newest config.step-N.gin); the new one is kept as "
        "MODEL_DIR/config.step-N.gin and later resumes compare with it",
    )
    summaries.add_progress_flag(parser)
    args = gin_utils.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    distributed.initialize(args)
    gin_utils.parse_gin(args)
    result = train(
        allow_config_change=args.allow_config_change,
        command_line_bindings=args.command_line_bindings,
        progress=args.progress,
    )
    if result["preempted"]:
        raise errors.Interrupted(
            result["signal"],
            (
                f"at step {result['step']}: saved {result['last_checkpoint']}; "
                "the same command resumes from it"
            ),
        )
    return 0
