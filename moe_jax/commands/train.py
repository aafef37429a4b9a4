"""`moe-jax train`: T5X-style gin-configured training (also `python -m moe_jax.train`).

    moe-jax train --gin_file=models/t5_moe.gin --gin_file=runs/pretrain.gin \\
        --gin.MODEL_DIR=/tmp/run --gin.TRAIN_STEPS=1000

The loop, in three pieces as in MaxText: :func:`setup_train_loop` restores the latest
checkpoint of ``MODEL_DIR`` (state, step, data-iterator position, RNG) or initialises,
into a :class:`TrainLoop` (the state the pieces share); :func:`train_loop` runs
:func:`training_loop_iteration` to the last step, which per step fetches this host's batch
shard, runs the jitted train step (state donated), checks the *previous* step's loss (so
the host never waits for the step it just dispatched), logs, saves every
``checkpoint_period`` steps (async), evaluates every ``eval_period`` steps and at the last
step. Steps that log, save or evaluate check their own loss first and fetch the metrics;
no other step fetches more than its loss. SIGTERM or Ctrl-C ends the step, saves a
checkpoint and exits 143 / 130 with one line naming it (a second Ctrl-C stops without
waiting for the step, naming the last finished checkpoint); a non-finite loss stops with
its step and the last good checkpoint (or, with ``train.on_nonfinite = 'skip'``, drops
that step's update).

Faults (docs/training.md, "Reliability"): one trainer per ``MODEL_DIR`` (``run_lock``);
an unreadable latest checkpoint is moved aside and the newest readable one used; a failed
write anywhere in ``MODEL_DIR`` (a checkpoint, ``metrics.jsonl``, TensorBoard, configs)
stops the run (exit 74) naming the file and the last good checkpoint; a resumption whose
run differs from the one recorded (``run.json``, or the newest ``run.step-N.json`` an
accepted change wrote; compared field by field, :mod:`~moe_jax.runtime.run_record`) is
refused unless ``--allow_config_change``, and an accepted data change is applied (the
stream restarts at the resumed step); parameters holding NaN/Inf are never saved; a start
refused before its first checkpoint leaves no ``MODEL_DIR``; ``metrics.jsonl`` and
TensorBoard records past the restored step are dropped on resume.

The run itself is one value, built from gin once, at :func:`train`'s start:
:class:`~moe_jax.runtime.run_spec.RunSpec` (:func:`~moe_jax.runtime.configured.train_spec`
says which gin name fills which field); the loop reads its settings from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from moe_jax import errors, partitioning, storage
from moe_jax.compile import aot
from moe_jax.runtime import (
    builders,
    checkpoints,
    configured,
    distributed,
    evaluation,
    gin_flags,
    gin_utils,
    profiling,
    router_init,
    run_lock,
    run_record,
    wandb_logger,
)
from moe_jax.runtime.background import Background
from moe_jax.runtime.checkpoint_checks import (
    UnreadableCheckpointError,
    check_integrity,
    nonfinite_leaves,
)
from moe_jax.runtime.metrics import MetricsWriter, drop_records_after
from moe_jax.runtime.model_protocol import Model
from moe_jax.runtime.progress import Progress, add_progress_flag
from moe_jax.runtime.routing_telemetry import ChurnProbe
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.run_spec import LoopSpec, RunSpec
from moe_jax.runtime.throughput import ThroughputMeter
from moe_jax.runtime.train_state import TrainState


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
        shuffle_buffer_size=cfg.shuffle_buffer_size,
    )


def stream_changes(saved: dict[str, Any], cfg: builders.DatasetConfig) -> list[str]:
    """How this process's stream of ``cfg`` differs from a saved iterator state (task,
    split, feature lengths, per-process batch size, seed, packing, cache, shuffle buffer), as
    ``"name: saved -> now"``; empty when the saved position continues the same stream."""
    now = {
        "mixture_or_task_name": cfg.mixture_or_task_name,
        "split": cfg.split,
        "task_feature_lengths": dict(cfg.task_feature_lengths),
        "batch_size": partitioning.per_process_batch_size(cfg.batch_size),
        "seed": cfg.seed,
        "pack": cfg.pack,
        "use_cached": cfg.use_cached,
        "shuffle_buffer_size": cfg.shuffle_buffer_size,
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


# Whether a run without a checkpoint builds its data pipeline while its step compiles
# (:func:`_stream_built_meanwhile`); tests compare with the stream built after the state.
_STREAM_MEANWHILE = True


@contextlib.contextmanager
def _stream_built_meanwhile(
    run_dir: RunDir, cfg: builders.DatasetConfig
) -> Iterator[Background[Any] | None]:
    """For a run without a checkpoint, its training stream (``make_iterator(cfg)``, the
    stream a fresh start reads) built on a background thread during the block, while the
    main thread compiles the train step and initialises the state: importing seqio and
    tracing the ``tf.data`` preprocessors hold the GIL, but the XLA compile and the
    pipeline's first batches (``tf.data`` 's own threads) do not. The stream waits, built,
    for :func:`setup_train_loop` to take it, which raises its errors where a stream built
    there would have; one the block did not take (it raised first) is closed at its end."""
    if not _STREAM_MEANWHILE or run_dir.reached_step() is not None:
        yield None
        return
    early = Background(lambda: make_iterator(cfg), "training data pipeline")
    try:
        yield early
    finally:
        if not early.taken:
            early.discard(lambda iterator: iterator.close())


@dataclasses.dataclass
class TrainLoop:
    """What the pieces of the loop share: built by :func:`setup_train_loop`, advanced a step
    at a time by :func:`training_loop_iteration`, run to its end by :func:`train_loop`."""

    spec: RunSpec
    run_dir: RunDir
    model: Model
    run: builders.TrainSetup
    step_fn: Callable[[TrainState, Any], tuple[TrainState, Any]]
    eval_fn: Callable[..., Any] | None  # None: no evaluation in the loop
    ckpt: checkpoints.Checkpointer
    iterator: Any  # the training stream (make_iterator)
    writer: MetricsWriter
    meter: ThroughputMeter
    ticker: Progress
    preemption: distributed.PreemptionWatcher
    profiler: profiling.StepProfiler
    state: TrainState
    step: int  # steps done (the state's step)
    end: int  # the step this invocation stops at
    last_saved: int | None  # the newest checkpoint written (or restored)
    first_step: int = dataclasses.field(init=False)  # the step this invocation started at
    batch: Any = None  # the next step's global batch
    data_state: Any = None  # the stream's position after the last dispatched step's batch
    unchecked: tuple[int, Any] | None = None  # (step, its metrics) whose loss is not read yet
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    preempted: bool = False  # SIGTERM or Ctrl-C: save at this step and stop
    churn: ChurnProbe | None = None  # built at the first evaluation
    start_time: float = dataclasses.field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.first_step = self.step

    @property
    def ctx(self) -> builders.RunContext:
        return self.run.ctx

    @property
    def settings(self) -> LoopSpec:
        """The loop's settings (:class:`~moe_jax.runtime.run_spec.LoopSpec`)."""
        return self.spec.loop

    def close(self) -> None:
        """Stops the stream and the progress bar, waits for the last save (raising its
        failure), and closes the metric files and the signal handlers."""
        self.profiler.close()
        self.iterator.close()
        self.ticker.close()
        self.ckpt.wait_until_finished()
        self.ckpt.close()
        self.writer.close()
        self.preemption.close()

    def result(self) -> dict[str, Any]:
        """:func:`train`'s result (see there)."""
        return {
            "step": self.step,
            "losses": self.losses,
            # a signal during the last step's evaluation or save stops nothing, but is said
            "preempted": self.preempted or self.preemption.signum is not None,
            "signal": self.preemption.signum,
            "finished": self.step == self.settings.total_steps,
            "model_dir": self.run_dir.path,
            "last_checkpoint": self.run_dir.checkpoint_name(self.last_saved),
            "wall_sec": time.perf_counter() - self.start_time,
        }


# Steps one invocation runs at most (None: to total_steps); tests of interrupted runs set it.
_STOP_AFTER_STEPS: int | None = None


def train(
    *,
    allow_config_change: bool = False,
    command_line_bindings: Sequence[str] = (),
    progress: str = "auto",
) -> dict[str, Any]:
    """Trains the run gin describes (built once, here:
    :func:`~moe_jax.runtime.configured.train_spec` gives its
    :class:`~moe_jax.runtime.run_spec.RunSpec` and ``MODEL_DIR``) to ``spec.loop.total_steps``,
    resuming from ``MODEL_DIR``'s latest checkpoint: :func:`setup_train_loop`, then
    :func:`train_loop`, holding the run directory's lock. What each loop setting does:
    :class:`~moe_jax.runtime.run_spec.LoopSpec`.

    Args:
      allow_config_change: resume although the run differs from the one last accepted
        (``--allow_config_change``; kept as ``run.step-N.json`` and ``config.step-N.gin``,
        which later resumptions compare with).
      command_line_bindings: the command line's gin binding lines; one binding a model
        config the built model never reads is refused.
      progress: ``'bar'``, ``'lines'`` or ``'auto'`` (``--progress``;
        :class:`~moe_jax.runtime.progress.Progress`).

    Returns:
      ``{"step", "losses": {step: loss}, "last_checkpoint", "preempted", "signal", "model_dir",
      "wall_sec", "finished"}``; ``preempted``: stopped by SIGTERM or Ctrl-C (``signal``, its
      number) after saving ``last_checkpoint`` (also during the last step's evaluation);
      ``finished``: at ``total_steps`` (a finished run started again: ``losses`` empty).

    Raises:
      WriteFailedError: a write to ``MODEL_DIR`` failed; names the file and the last good
        checkpoint.
      Interrupted: a second Ctrl-C (or one before the training loop) stopped the run before
        a checkpoint was saved; names the last checkpoint.
    """
    spec, model_dir = configured.train_spec()
    _check_loop_settings(spec.loop)
    run_dir = RunDir(_checked_model_dir(model_dir))
    _check_total_steps(spec.loop.total_steps, run_dir)
    with _holding(run_dir):
        if (finished := _finished_run(run_dir, spec.loop.total_steps)) is not None:
            return finished
        with _stream_built_meanwhile(run_dir, spec.data.train) as early_stream:
            loop = setup_train_loop(
                spec,
                run_dir,
                progress=progress,
                allow_config_change=allow_config_change,
                command_line_bindings=command_line_bindings,
                early_stream=early_stream,
            )
        return train_loop(loop)


def setup_train_loop(
    spec: RunSpec,
    run_dir: RunDir,
    *,
    progress: str = "auto",
    allow_config_change: bool = False,
    command_line_bindings: Sequence[str] = (),
    early_stream: Background[Any] | None = None,
) -> TrainLoop:
    """Builds the run ``spec`` describes (mesh, sharded state layout, the train step
    compiled and checked to fit), restores the newest readable checkpoint of ``run_dir`` or
    initialises, starts the data stream where the checkpoint left it (a fresh start takes
    ``early_stream``'s, built meanwhile: :func:`_stream_built_meanwhile`), and records the
    run's config (refusing a changed one unless ``allow_config_change``); the caller holds
    the run's lock."""
    settings, train_cfg, eval_cfg = spec.loop, spec.data.train, spec.data.eval
    model = spec.model.build()
    model.check_vocabulary()
    ctx = spec.mesh.context()
    input_shapes = train_cfg.input_shapes()
    run = spec.train_setup(model, ctx)
    _refuse_unread_bindings(command_line_bindings)
    _log("compiling the train step (and checking that it fits)")
    step_fn = aot.check_fits(run, train_cfg, model)  # before any state exists
    ckpt = checkpoints.Checkpointer(
        run_dir,
        save_period=settings.checkpoint.period,
        keep=settings.checkpoint.keep,
        async_save=settings.checkpoint.async_save,
        remove_partial_saves=True,
    )
    state, meta, latest = _restore_or_init(ckpt, run, model, spec.seed)
    if early_stream is not None and meta is None:
        if not early_stream.done:
            _log("waiting for the data pipeline (built while the train step compiled)")
        iterator, restart = early_stream.result(), None  # its errors raised here, as they were
    else:
        _log("starting the data pipeline")
        iterator, restart = _resumed_iterator(train_cfg, meta, latest)
    _record_run(run_dir, spec, latest or 0, allow_config_change, restart)
    _log(
        f"{model.num_params(state.params):,} parameters; mesh {dict(ctx.mesh.shape)}; "
        f"{jax.process_count()} process(es), {jax.device_count()} devices"
    )
    tokens_per_step = int(
        np.prod(input_shapes["decoder_input_tokens"])
        + np.prod(input_shapes["encoder_input_tokens"])
    )
    step = int(jax.device_get(state.step))
    return TrainLoop(
        spec=spec,
        run_dir=run_dir,
        model=model,
        run=run,
        step_fn=step_fn,
        eval_fn=run.jitted_eval_step if eval_cfg is not None and settings.eval.period else None,
        ckpt=ckpt,
        iterator=iterator,
        writer=MetricsWriter(
            run_dir, int(dict(ctx.mesh.shape).get("expert", 1)), wandb_logger.start(run_dir)
        ),
        meter=ThroughputMeter(
            model.flops_per_step(input_shapes),
            tokens_per_step,
            # on CPU a measured matmul: at the first log, not before the first step
            lambda: configured.peak_flops_per_device() * jax.device_count(),
        ),
        ticker=Progress(step, settings.total_steps, progress),
        preemption=distributed.PreemptionWatcher(),
        profiler=profiling.StepProfiler(settings.profile_steps, run_dir.profile_dir, _log),
        state=state,
        step=step,
        end=_loop_end(step, settings.total_steps),
        last_saved=latest,
    )


def train_loop(loop: TrainLoop) -> dict[str, Any]:
    """Runs ``loop`` from its step to its end, or to the step a SIGTERM or Ctrl-C stops it
    at (after saving a checkpoint there), then closes what it holds.

    Returns:
      :meth:`TrainLoop.result`.
    """
    try:
        loop.batch = builders.global_batch(
            builders.first_batch(loop.iterator, loop.spec.data.train), loop.ctx
        )
        while loop.step < loop.end and not loop.preempted:
            training_loop_iteration(loop)
    finally:
        loop.close()
    return loop.result()


def training_loop_iteration(loop: TrainLoop) -> None:
    """One step: dispatch it (the state donated), fetch the next batch while the device
    works, check the *previous* step's loss (so the host never waits for the step it just
    dispatched); then, when this step logs, saves or evaluates, check its own loss first
    and do those."""
    s = loop.settings
    loop.profiler.before_step(loop.step)
    loop.state, metrics = loop.step_fn(loop.state, loop.batch)  # async dispatch
    if loop.step == loop.first_step:  # said once, when it is done: the run is under way
        loop.ticker.write(f"step {loop.step + 1} done: loss {float(metrics['loss']):.4f}")
    loop.data_state = loop.iterator.get_state()  # position after this step's batch
    if loop.step + 1 < loop.end:
        loop.batch = builders.global_batch(next(loop.iterator), loop.ctx)
    if s.sync_every_step:
        metrics = jax.device_get(metrics)
    loop.ckpt.check_for_errors()  # a failed background save stops here
    loop.step += 1
    loop.profiler.after_step(loop.step, metrics)
    loop.meter.tick()
    loop.ticker.update()
    if loop.unchecked is not None:  # the previous step: done, or queued just before this one
        _check_loss(loop, *loop.unchecked)
    loop.unchecked = (loop.step, metrics)
    loop.preempted = loop.preemption.reached(loop.step)
    step = loop.step
    log_now = step % s.log_period == 0 or step == loop.end
    save_now = step % s.checkpoint.period == 0 or step == loop.end or loop.preempted
    eval_now = loop.eval_fn is not None and (step % s.eval.period == 0 or step == s.total_steps)
    if not (s.sync_every_step or log_now or save_now or eval_now):
        return
    loss = _check_loss(loop, *loop.unchecked)  # waits for this step
    loop.unchecked = None
    if log_now:
        rates = loop.meter.rates()
        loop.writer.write("train", step, {**jax.device_get(metrics), **rates})
        loop.ticker.log(step, loss, rates["tokens_per_sec"])
    if save_now:
        _save(loop)
    if eval_now and not loop.preempted:
        _evaluate(loop)


def _loop_end(step: int, total_steps: int) -> int:
    """The step this invocation stops at: ``total_steps``, or earlier with
    :data:`_STOP_AFTER_STEPS`."""
    if _STOP_AFTER_STEPS is None:
        return total_steps
    return min(total_steps, step + _STOP_AFTER_STEPS)


def _restore_or_init(
    ckpt: checkpoints.Checkpointer, run: builders.TrainSetup, model: Model, random_seed: int
) -> tuple[TrainState, dict[str, Any] | None, int | None]:
    """``(state, its checkpoint's metadata, its step)`` of the newest readable checkpoint
    (damaged newer ones set aside), or of a fresh initialisation (``None, None``; the
    routers' initial weights kept). Refuses another ``random_seed`` than the checkpoint's,
    and a start from step 0 while damaged steps are set aside."""
    run_dir = ckpt.run_dir
    set_aside = run_dir.set_aside_steps()  # at earlier starts
    restored = checkpoints.restore_latest_readable(ckpt, run.abstract_state, _log)
    _check_set_aside(run_dir, set_aside, fresh=restored is None)
    if restored is None:
        _log("initialising the parameters and optimizer state")
        state = run.init_state()
        router_init.save(run_dir, model, state.params)
        return state, None, None
    state, meta, latest = restored
    _check_random_seed(meta, random_seed, run_dir.checkpoint_name(latest))
    _log(f"restored {run_dir.step_dir(latest)}")
    return state, meta, latest


def _record_run(
    run_dir: RunDir, spec: RunSpec, step: int, allow_config_change: bool, restart: str | None
) -> None:
    """Records the run's spec and gin config at ``step`` (``run_record.record_run``: process
    0 decides; a changed field is refused unless ``allow_config_change``), says why the data
    stream restarts (once the change is accepted), drops the metrics logged after ``step``
    and records the eval settings (for `moe-jax eval` to reproduce this run's evaluation)."""
    distributed.process_zero_decides(
        lambda: run_record.record_run(
            run_dir, spec, gin_utils.operative_config(), step, allow_change=allow_config_change
        ),
        lambda: errors.UserError("refused on process 0 (see its message)"),
    )
    if restart:
        _log(restart)
    if jax.process_index() == 0:
        drop_records_after(run_dir, step)
        if spec.data.eval is not None:
            evaluation.record_eval_settings(run_dir, spec.loop.eval.steps, spec.data.eval)


def _check_loss(loop: TrainLoop, step: int, metrics: Any) -> float:
    """Fetches one step's loss (a scalar), keeps it, and stops on NaN/Inf when asked to.

    Raises:
      NonFiniteLossError: naming the step and the last good checkpoint.
    """
    loss = float(metrics["loss"])
    loop.losses[step] = loss
    if not np.isfinite(loss) and loop.settings.on_nonfinite == "stop":
        raise NonFiniteLossError(
            f"loss is {loss} at step {step}; last good checkpoint: "
            f"{loop.run_dir.checkpoint_name(loop.last_saved)}. Restarting resumes from it; bind "
            "train.on_nonfinite='skip' to skip such steps instead."
        )
    return loss


def _save(loop: TrainLoop) -> None:
    """Saves the state (async) with every process's data position, after checking its
    parameters are finite, and makes the metrics written so far durable."""
    _check_state(
        loop.state.params,
        loop.state.opt_state,
        loop.step,
        loop.run_dir.checkpoint_name(loop.last_saved),
    )
    meta = {
        "data_iterators": distributed.gather_from_processes(loop.data_state),
        "random_seed": loop.spec.seed,
    }
    if loop.ckpt.save(loop.state, meta, force=True):
        loop.last_saved = loop.step
    loop.writer.flush()


def _evaluate(loop: TrainLoop) -> None:
    """Evaluates the state on ``eval_steps`` batches (and the routing churn since the last
    evaluation) and logs it."""
    eval_cfg = loop.spec.data.eval
    assert loop.eval_fn is not None and eval_cfg is not None  # eval_fn needs an eval dataset
    state = loop.state
    metrics = evaluation.run_eval(
        loop.eval_fn, state.params, eval_cfg, loop.ctx, loop.settings.eval.steps, state.collections
    )
    if loop.settings.eval.routing_churn:
        loop.churn = loop.churn or _churn_probe(loop.model, loop.run, eval_cfg, loop.run_dir)
        metrics.update(loop.churn(state.params, state.collections))
    loop.writer.write("eval", loop.step, metrics)
    loop.ticker.write(
        f"step {loop.step}: eval loss {metrics['loss']:.4f} accuracy {metrics['accuracy']:.4f}"
    )


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
def _holding(run_dir: RunDir) -> Iterator[None]:
    """Holds ``run_dir``'s lock for the block. A failed write or an interrupt that stopped
    it without saving names the last checkpoint; a run refused before its first checkpoint
    (vocabulary, experts, mesh, data) leaves no ``MODEL_DIR`` behind when it created it."""
    created = not run_dir.exists()
    run_dir.check_writable()
    try:
        with run_lock.hold(run_dir), _naming_last_checkpoint(run_dir):
            yield
    except Exception as err:
        refused = not isinstance(err, NonFiniteLossError | errors.WriteFailedError)
        if created and refused and jax.process_index() == 0 and run_dir.reached_step() is None:
            storage.rmtree(run_dir.path)
        raise


@contextlib.contextmanager
def _naming_last_checkpoint(run_dir: RunDir) -> Iterator[None]:
    """Adds the run's last checkpoint (and how to resume) to a failed write and an
    interrupt that stopped the block without saving."""
    try:
        yield
    except errors.WriteFailedError as err:
        if err.names_last_good:
            raise
        raise errors.WriteFailedError(
            f"{err}; last good checkpoint: {_last_checkpoint(run_dir)}", names_last_good=True
        ) from err
    except KeyboardInterrupt as err:
        if isinstance(err, errors.Interrupted) and err.detail:
            raise
        latest = _last_checkpoint(run_dir)
        then = (
            "no checkpoint yet: the same command starts the run again"
            if latest == "none yet"
            else f"last checkpoint: {latest}; the same command resumes from it"
        )
        raise errors.Interrupted(
            getattr(err, "signum", signal.SIGINT), f"nothing saved at this stop; {then}"
        ) from None


def _last_checkpoint(run_dir: RunDir) -> str:
    """``MODEL_DIR/checkpoints/STEP`` of the newest finished checkpoint, or ``"none yet"``."""
    return run_dir.checkpoint_name(run_dir.reached_step())


def _churn_probe(
    model: Model, run: builders.TrainSetup, eval_cfg: builders.DatasetConfig, run_dir: RunDir
) -> ChurnProbe:
    """The routing-churn probe of a run: the first eval batch is its fixed probe batch."""
    probe_batch = next(builders.eval_batches(eval_cfg, 1))
    return ChurnProbe(
        model, run.shardings.params, run.ctx, probe_batch, run_dir, run.shardings.collections
    )


def _check_total_steps(total_steps: Any, run_dir: RunDir) -> None:
    """Refuses a ``TRAIN_STEPS`` that is not a positive integer or is below the step the
    run already reached (before anything is written)."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
        raise errors.ConfigError(
            f"TRAIN_STEPS (train_script.train.total_steps) = {total_steps!r}; "
            "expected a positive integer"
        )
    reached = run_dir.reached_step()
    if reached is not None and total_steps < reached:
        raise errors.ConfigError(
            f"TRAIN_STEPS={total_steps} is below step {reached}, which MODEL_DIR={run_dir} "
            f"already reached; pass TRAIN_STEPS >= {reached} to continue it, or another MODEL_DIR"
        )


def _check_state(params: Any, opt_state: Any, step: int, last_saved: str) -> None:
    """Stops before saving parameters or an optimizer state that hold NaN or Inf (a finite
    loss came before the update that broke them): every checkpoint of a run is finite.

    Raises:
      NonFiniteLossError: naming the step, the first such array and the last good checkpoint.
    """
    for what, tree in (("parameters hold", params), ("the optimizer state holds", opt_state)):
        bad = nonfinite_leaves(tree)
        if bad:
            raise NonFiniteLossError(
                f"{what} NaN or Inf after step {step} ({bad[0]}, {len(bad)} in all); "
                f"not saved; last good checkpoint: {last_saved}"
            )


# The loop's settings that count steps or checkpoints: (gin parameter of train_script.train,
# its LoopSpec field, least value, what it means there).
_AT_LEAST = (
    ("checkpoint_period", "checkpoint.period", 1, "a positive integer"),
    (
        "keep_checkpoints",
        "checkpoint.keep",
        1,
        "a positive integer, or None to keep every checkpoint",
    ),
    ("log_period", "log_period", 1, "a positive integer"),
    ("eval_period", "eval.period", 0, "0 (never) or a positive integer"),
    ("eval_steps", "eval.steps", 1, "a positive integer"),
    ("accum_steps", "accum_steps", 1, "a positive integer"),
)


def _check_loop_settings(settings: LoopSpec) -> None:
    """Refuses a loop setting no run can use (``keep_checkpoints = 0`` would keep no
    checkpoint, ``checkpoint_period = -1`` save every step; an unknown ``on_nonfinite``),
    before anything is written.

    Raises:
      ConfigError: naming the first such ``train_script.train`` parameter and its value.
    """
    if settings.on_nonfinite not in ("stop", "skip"):
        raise errors.ConfigError(
            f"train.on_nonfinite={settings.on_nonfinite!r}; expected 'stop' or 'skip'"
        )
    for name, field, least, expected in _AT_LEAST:
        value = operator.attrgetter(field)(settings)
        if value is None and name == "keep_checkpoints":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise errors.ConfigError(f"train_script.train.{name} = {value!r}; expected {expected}")


def _checked_model_dir(model_dir: Any) -> str:
    """``model_dir`` when it names a directory: an empty path (``MODEL_DIR=''``) would be
    the working directory, and ``runs/smoke_cpu.gin`` leaves it ``None`` for the user to set.

    Raises:
      ConfigError: naming ``MODEL_DIR`` and its value.
    """
    if isinstance(model_dir, str) and model_dir.strip():
        return model_dir
    why = (
        " (an empty path would put the run into the working directory)"
        if isinstance(model_dir, str)
        else "; pass --gin.MODEL_DIR=DIR (a new directory, or a run's to resume it)"
    )
    raise errors.ConfigError(
        f"MODEL_DIR (train_script.train.model_dir) = {model_dir!r}: expected a directory{why}"
    )


def _finished_run(run_dir: RunDir, total_steps: int) -> dict[str, Any] | None:
    """:func:`train`'s result for a run whose newest checkpoint is ``total_steps`` and
    matches its integrity record (said in one line, after the steps set aside earlier;
    nothing compiled, restored or written), else None: the run trains (a step without a
    record, or a damaged one, is checked by restoring it)."""
    reached = run_dir.reached_step()
    if reached != total_steps:
        return None
    try:
        if not check_integrity(run_dir.step_dir(reached), reached):
            return None
    except UnreadableCheckpointError:
        return None
    _check_set_aside(run_dir, run_dir.set_aside_steps(), fresh=False)  # named at every start
    _log(
        f"MODEL_DIR={run_dir} already reached TRAIN_STEPS={total_steps} "
        f"({run_dir.step_dir(reached)}): nothing to train; pass a larger TRAIN_STEPS to "
        "continue it"
    )
    return {
        "step": reached,
        "losses": {},
        "preempted": False,
        "signal": None,
        "model_dir": run_dir.path,
        "last_checkpoint": run_dir.checkpoint_name(reached),
        "wall_sec": 0.0,
        "finished": True,
    }


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


def _check_set_aside(run_dir: RunDir, aside: list[int], *, fresh: bool) -> None:
    """Names the damaged checkpoints set aside at earlier starts (at every start until they
    are deleted), and refuses to train from step 0 while they are there."""
    if not aside:
        return
    folder = run_dir.unreadable_dir
    if fresh:
        raise errors.CheckpointError(
            f"MODEL_DIR={run_dir} has no readable checkpoint, but {folder} holds step(s) {aside} "
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
        help="resume although the run's config differs from the one recorded (run.json "
        "or the newest run.step-N.json; config.gin for a run of an older version); the new "
        "one is kept as MODEL_DIR/run.step-N.json and config.step-N.gin and later resumes "
        "compare with it",
    )
    add_progress_flag(parser)
    args = gin_flags.parse_flags(parser, sys.argv[1:] if argv is None else argv)
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
                f"at step {result['step']}, the run's last: saved {result['last_checkpoint']}; "
                "the run is complete"
                if result["finished"]
                else f"at step {result['step']}: saved {result['last_checkpoint']}; "
                "the same command resumes from it"
            ),
        )
    return 0
