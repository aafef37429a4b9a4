"""The layout of a run directory (``MODEL_DIR``): :class:`RunDir` names every path in it.

    MODEL_DIR/
      checkpoints/<step>/           one orbax checkpoint (params, train, meta; checkpoints.py)
      unreadable_checkpoints/<step> damaged steps set aside at a start, never deleted
      config.gin                    the operative gin config of the run's first start
      config.step-<N>.gin           a config change accepted when resuming at step N
      run.json                      the run's RunSpec as of its first start (run_record.py)
      run.step-<N>.json             its spec as accepted at step N (a change, or a run an
                                    older version started, first resumed at N)
      LOCK                          the trainer's lock (run_lock.py)
      metrics.jsonl                 one JSON record per logged step (metrics.py)
      train/, eval/                 TensorBoard event files, one folder per split (event_files.py)
      eval_settings.json            the in-training evaluation's settings (evaluation.py)
      router_init.npz               the routers' initial weights (router_init.py)
      routing_probe.npz             the routing-churn probe's last top-1 choices
      vocabulary.model              an imported run's vocabulary (`moe-jax import`)
      .write_probe_<process>        written and removed at a start (the directory is writable)
      eval_results/, analysis/      where `moe-jax eval` and `moe-jax analyze` write by default
      log.txt, DONE                 a sweep's log of the run and its mark of a finished run

Paths are strings built with :mod:`moe_jax.storage`, so a run directory on a local disk and
one on ``gs://`` are the same type. Every module that reads or writes a file of a run takes
a :class:`RunDir` and asks it for the path; none joins a file name to ``MODEL_DIR`` itself.
"""

from __future__ import annotations

import dataclasses
import re

import jax

from moe_jax import errors, storage

_ACCEPTED_CONFIG = re.compile(r"config\.step-(\d+)\.gin")
_ACCEPTED_SPEC = re.compile(r"run\.step-(\d+)\.json")


class UnwritableModelDirError(errors.UserError, PermissionError):
    """``MODEL_DIR`` cannot be written (found before anything is built)."""


@dataclasses.dataclass(frozen=True)
class RunDir:
    """One run directory: ``path`` (normalised by :func:`moe_jax.storage.normalize`: a
    local path absolute, a URL without a trailing slash) and the paths of its files."""

    path: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", storage.normalize(self.path))

    def __str__(self) -> str:
        return self.path

    @classmethod
    def of_checkpoint(cls, path: storage.PathLike) -> tuple[RunDir, int | None]:
        """The run a checkpoint path names and its step: ``DIR`` -> (DIR, None: the latest);
        ``DIR/STEP`` or ``DIR/checkpoints/STEP`` -> (DIR, STEP)."""
        path = storage.normalize(path)
        name = storage.basename(path)
        if not name.isdigit():
            return cls(path), None
        parent = storage.parent(path)
        if storage.basename(parent) == "checkpoints":
            parent = storage.parent(parent)
        return cls(parent), int(name)

    def _file(self, name: str) -> str:
        return storage.join(self.path, name)

    # ----------------------------------------------------------------------- checkpoints

    @property
    def checkpoints_dir(self) -> str:
        """``MODEL_DIR/checkpoints``: the orbax manager's folder, one sub-folder per step."""
        return self._file("checkpoints")

    def step_dir(self, step: int) -> str:
        """``MODEL_DIR/checkpoints/<step>``."""
        return storage.join(self.checkpoints_dir, str(step))

    def checkpoint_name(self, step: int | None) -> str:
        """How messages name a checkpoint: ``MODEL_DIR/checkpoints/STEP``, or ``"none yet"``."""
        return "none yet" if step is None else self.step_dir(step)

    def reached_step(self) -> int | None:
        """The newest checkpoint step (None: none), read from the folder names without
        creating anything; a plain file named like a step (``checkpoints/9``) is none."""
        steps = [int(name) for name in storage.listdir(self.checkpoints_dir) if name.isdigit()]
        for step in sorted(steps, reverse=True):
            if storage.isdir(self.step_dir(step)):
                return step
        return None

    @property
    def unreadable_dir(self) -> str:
        """``MODEL_DIR/unreadable_checkpoints``: damaged steps moved aside."""
        return self._file("unreadable_checkpoints")

    def set_aside_path(self, step: int) -> str:
        """Where a damaged ``step`` is moved: ``unreadable_checkpoints/<step>``, or
        ``<step>.<n>`` when that step was set aside before."""
        dest = storage.join(self.unreadable_dir, str(step))
        if storage.exists(dest):
            dest = f"{dest}.{len(storage.listdir(self.unreadable_dir))}"
        return dest

    def set_aside_steps(self) -> list[int]:
        """The steps in ``unreadable_checkpoints`` (set aside as damaged)."""
        stems = {name.split(".")[0] for name in storage.listdir(self.unreadable_dir)}
        return sorted(int(stem) for stem in stems if stem.isdigit())

    # -------------------------------------------------------------------------- configs

    @property
    def config_file(self) -> str:
        """``MODEL_DIR/config.gin``: the operative gin config of the first start."""
        return self._file("config.gin")

    def accepted_config_file(self, step: int) -> str:
        """``MODEL_DIR/config.step-<step>.gin``: a config change accepted at ``step``."""
        return self._file(f"config.step-{step}.gin")

    def recorded_config(self, step: int | None = None) -> str:
        """The run's gin config as of ``step``: the newest ``config.step-N.gin`` with N <=
        ``step`` (any N when ``step`` is None), else ``config.gin``."""
        return self._newest_accepted(_ACCEPTED_CONFIG, step) or self.config_file

    @property
    def spec_file(self) -> str:
        """``MODEL_DIR/run.json``: the run's spec as of its first start."""
        return self._file("run.json")

    def accepted_spec_file(self, step: int) -> str:
        """``MODEL_DIR/run.step-<step>.json``: the run's spec as accepted at ``step``."""
        return self._file(f"run.step-{step}.json")

    def recorded_spec(self, step: int | None = None) -> str | None:
        """The run's spec as of ``step``: the newest ``run.step-N.json`` with N <= ``step``
        (any N when ``step`` is None), else ``run.json``; None when neither exists (a run of
        an older version, before its first resumption)."""
        found = self._newest_accepted(_ACCEPTED_SPEC, step)
        if found is None and storage.exists(self.spec_file):
            found = self.spec_file
        return found

    def _newest_accepted(self, pattern: re.Pattern[str], step: int | None) -> str | None:
        """The file named ``pattern`` (its group: a step) of the largest step <= ``step``
        (any step when None); None when there is none."""
        accepted = {
            int(m.group(1)): name
            for name in storage.listdir(self.path)
            if (m := pattern.fullmatch(name)) and (step is None or int(m.group(1)) <= step)
        }
        return self._file(accepted[max(accepted)]) if accepted else None

    # ---------------------------------------------------------------- what a run writes

    @property
    def lock_file(self) -> str:
        """``MODEL_DIR/LOCK``: held by the one trainer of the run."""
        return self._file("LOCK")

    @property
    def metrics_file(self) -> str:
        """``MODEL_DIR/metrics.jsonl``: one JSON record per logged step and evaluation."""
        return self._file("metrics.jsonl")

    EVENT_SPLITS = ("train", "eval")

    def events_dir(self, split: str) -> str:
        """``MODEL_DIR/<split>``: the TensorBoard event files of ``split`` (train, eval)."""
        return self._file(split)

    @property
    def profile_dir(self) -> str:
        """``MODEL_DIR/profile``: device traces of ``train.profile_steps``
        (``tensorboard --logdir MODEL_DIR/profile``, Profile tab)."""
        return self._file("profile")

    @property
    def eval_settings_file(self) -> str:
        """``MODEL_DIR/eval_settings.json``: what the in-training evaluation reads."""
        return self._file("eval_settings.json")

    @property
    def router_init_file(self) -> str:
        """``MODEL_DIR/router_init.npz``: the routers' initial weights."""
        return self._file("router_init.npz")

    @property
    def routing_probe_file(self) -> str:
        """``MODEL_DIR/routing_probe.npz``: the churn probe's top-1 experts at the last eval."""
        return self._file("routing_probe.npz")

    @property
    def vocabulary_file(self) -> str:
        """``MODEL_DIR/vocabulary.model``: an imported run's copy of its export's vocabulary."""
        return self._file("vocabulary.model")

    @property
    def eval_results_dir(self) -> str:
        """``MODEL_DIR/eval_results``: `moe-jax eval`'s default output folder."""
        return self._file("eval_results")

    @property
    def analysis_dir(self) -> str:
        """``MODEL_DIR/analysis``: `moe-jax analyze`'s default output folder."""
        return self._file("analysis")

    @property
    def log_file(self) -> str:
        """``MODEL_DIR/log.txt``: a sweep's log of the run."""
        return self._file("log.txt")

    @property
    def done_file(self) -> str:
        """``MODEL_DIR/DONE``: a sweep's mark of a run that finished cleanly."""
        return self._file("DONE")

    # ------------------------------------------------------------------------- the folder

    def exists(self) -> bool:
        return storage.exists(self.path)

    def holds_run(self) -> bool:
        """The folder is a run directory: it has ``checkpoints/`` or a ``LOCK``."""
        return storage.exists(self.checkpoints_dir) or storage.exists(self.lock_file)

    def check_writable(self) -> None:
        """Refuses a run directory that cannot be written, before any training starts: each
        process writes and deletes a probe file (an object on GCS).

        Raises:
          UnwritableModelDirError: naming ``MODEL_DIR`` and the cause.
        """
        probe = self._file(f".write_probe_{jax.process_index()}")
        try:
            storage.makedirs(self.path)
            storage.write_text(probe, "ok")
            storage.remove(probe)
        except OSError as err:
            raise UnwritableModelDirError(
                f"MODEL_DIR={self.path!r} is not writable ({err.strerror or err})"
            ) from None
