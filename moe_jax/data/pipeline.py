"""Training input pipeline: seqio task -> packed EncDec model features -> host batches ->
global ``jax.Array`` batches.

* ``get_dataset``: a ``tf.data.Dataset`` of per-host batches, each feature ``[batch, length]``
  int32: ``encoder_input_tokens``, ``decoder_input_tokens``, ``decoder_target_tokens``,
  ``decoder_loss_weights`` and, when packed, ``encoder_segment_ids``,
  ``decoder_segment_ids``, ``encoder_positions``, ``decoder_positions``.
* ``TrainIterator``: numpy batches from ``get_dataset`` with a background prefetch thread;
  deterministic given the seed and resumable: its JSON state holds the step, and restoring
  at step N deterministically skips N batches, so the trainer sees the batch it would have
  seen at step N.
* ``to_global_batch``: assembles the hosts' batches into global arrays on the mesh.

seqio, TensorFlow and the task registry are imported when data is read, not with this
module, so gin files that configure ``get_dataset`` can be parsed where only the model is
needed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_jax import partitioning
from moe_jax.data.vocab import selected_vocabulary

if TYPE_CHECKING:
    import seqio
    import tensorflow as tf

_STATE_KEYS = (
    "mixture_or_task_name",
    "task_feature_lengths",
    "split",
    "batch_size",
    "seed",
    "shard_index",
    "num_shards",
    "pack",
    "use_cached",
    "shuffle_buffer_size",
)


def host_shard_info() -> seqio.ShardInfo:
    """This host's shard of the data: ``jax.process_index()`` of ``jax.process_count()``."""
    import seqio  # deferred: parsing gin needs neither seqio nor TensorFlow

    return seqio.ShardInfo(index=jax.process_index(), num_shards=jax.process_count())


def get_provider(mixture_or_task_name: str) -> seqio.DatasetProviderBase:
    """The registered task or mixture (a text-corpus group task is registered on first
    use), or a ``ValueError`` naming ``MIXTURE_OR_TASK_NAME``."""
    import seqio  # deferred: parsing gin needs neither seqio nor TensorFlow

    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import tasks

    tasks.register_group_task(mixture_or_task_name)
    try:
        return seqio.get_mixture_or_task(mixture_or_task_name)
    except ValueError as e:
        known = [
            tasks.task_name(objective, prefix=prefix)
            for prefix in ("mc4", tasks.TEXT_PREFIX)
            for objective in tasks.OBJECTIVES
        ]
        raise ValueError(
            f"unknown task or mixture MIXTURE_OR_TASK_NAME="
            f"{mixture_or_task_name!r}; the project registers {known}, "
            "mc4_<lang>_<objective> for every mC4 language and "
            "text_<label>_<objective> for the text corpus' groups; set "
            "MIXTURE_OR_TASK_MODULE to the module registering your own"
        ) from e


def get_dataset(
    mixture_or_task_name: str,
    task_feature_lengths: Mapping[str, int],
    split: str,
    batch_size: int,
    shuffle: bool,
    seed: int | None,
    shard_info: seqio.ShardInfo | None = None,
    pack: bool = True,
    num_epochs: int | None = None,
    use_cached: bool = False,
    shuffle_buffer_size: int | None = None,
) -> tf.data.Dataset:
    """Per-host batches of ``seqio.EncDecFeatureConverter`` features (see module docstring).

    Args:
      mixture_or_task_name: a registered task/mixture (gin ``MIXTURE_OR_TASK_NAME``).
      task_feature_lengths: ``{"inputs": I, "targets": T}`` (gin ``TASK_FEATURE_LENGTHS``).
      split: ``"train"`` or ``"validation"``.
      batch_size: examples per host and batch (packed examples when ``pack``).
      shuffle: shuffle files and examples (seeded).
      seed: makes the stream deterministic; ``None`` draws a fresh one.
      shard_info: this host's shard (``host_shard_info()`` in training); ``None``: all data.
      pack: pack several examples per row (adds segment ids and positions).
      num_epochs: passes over the data; ``None`` repeats forever.
      use_cached: read the seqio cache (``USE_CACHED_TASKS``) made by seqio's cache job.
      shuffle_buffer_size: overrides the task's shuffle buffer (10 000).

    Returns:
      ``tf.data.Dataset`` of dicts ``{feature: int32 [batch_size, length]}``; incomplete
      final batches are dropped.
    """
    import seqio  # deferred: parsing gin needs neither seqio nor TensorFlow
    import tensorflow as tf

    provider = get_provider(mixture_or_task_name)
    selected_vocabulary()  # a missing model file is reported here, not inside tf.data tracing
    lengths = dict(task_feature_lengths)
    kwargs: dict[str, Any] = {}
    if isinstance(provider, seqio.Task):
        kwargs["shuffle_buffer_size"] = shuffle_buffer_size
    ds = provider.get_dataset(
        sequence_length=lengths,
        split=split,
        use_cached=use_cached,
        shuffle=shuffle,
        seed=seed,
        shard_info=shard_info,
        num_epochs=num_epochs,
        **kwargs,
    )
    ds = seqio.EncDecFeatureConverter(pack=pack)(ds, lengths)
    ds = ds.batch(batch_size, drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = True
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


class TrainIterator:
    """Resumable, deterministic iterator of numpy batches (``get_dataset`` features).

    ``next(it)`` returns the batch of step ``it.step`` and advances the step. A background
    thread keeps up to ``prefetch`` batches ready. ``get_state()`` is JSON-serialisable;
    ``TrainIterator.restore(state)`` continues exactly where the saved iterator was.
    """

    def __init__(
        self,
        mixture_or_task_name: str,
        task_feature_lengths: Mapping[str, int],
        batch_size: int,
        seed: int | None,
        shard_info: seqio.ShardInfo | None = None,
        split: str = "train",
        pack: bool = True,
        use_cached: bool = False,
        start_step: int = 0,
        prefetch: int = 2,
        shuffle_buffer_size: int | None = None,
    ):
        if seed is None:
            raise ValueError(
                "TrainIterator needs an integer seed (it is what makes restarts reproducible)"
            )
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        shard_info = host_shard_info() if shard_info is None else shard_info
        self._config = {
            "mixture_or_task_name": mixture_or_task_name,
            "task_feature_lengths": dict(task_feature_lengths),
            "split": split,
            "batch_size": batch_size,
            "seed": seed,
            "shard_index": shard_info.index,
            "num_shards": shard_info.num_shards,
            "pack": pack,
            "use_cached": use_cached,
            "shuffle_buffer_size": shuffle_buffer_size,
        }
        self.step = start_step
        ds = get_dataset(
            mixture_or_task_name,
            task_feature_lengths,
            split,
            batch_size,
            shuffle=True,
            seed=seed,
            shard_info=shard_info,
            pack=pack,
            num_epochs=None,
            use_cached=use_cached,
            shuffle_buffer_size=shuffle_buffer_size,
        )
        self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce,
            args=(ds.skip(start_step),),
            name="TrainIterator-prefetch",
            daemon=True,
        )
        self._thread.start()

    def _produce(self, ds: tf.data.Dataset) -> None:
        try:
            for batch in ds.as_numpy_iterator():
                if not self._put(batch):
                    return
            self._put(StopIteration())
        except Exception as e:  # pylint: disable=broad-except  # re-raised in __next__
            self._put(e)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put(item)  # later calls raise it again
            raise item
        self.step += 1
        return item

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state: the configuration and the next step to be returned."""
        return {**self._config, "step": self.step}

    @classmethod
    def restore(cls, state: Mapping[str, Any], prefetch: int = 2) -> TrainIterator:
        """The iterator that continues ``state`` (from ``get_state()``)."""
        import seqio  # deferred: parsing gin needs neither seqio nor TensorFlow

        missing = [k for k in (*_STATE_KEYS, "step") if k not in state]
        if missing:
            raise ValueError(f"iterator state lacks {missing}")
        return cls(
            state["mixture_or_task_name"],
            state["task_feature_lengths"],
            state["batch_size"],
            state["seed"],
            shard_info=seqio.ShardInfo(state["shard_index"], state["num_shards"]),
            split=state["split"],
            pack=state["pack"],
            use_cached=state["use_cached"],
            start_step=state["step"],
            prefetch=prefetch,
            shuffle_buffer_size=state["shuffle_buffer_size"],
        )

    def close(self) -> None:
        """Stops the prefetch thread (idempotent)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> TrainIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()


def to_global_batch(
    local_batch: Mapping[str, np.ndarray],
    mesh: Mesh,
    batch_axes: Sequence[str] = partitioning.BATCH_AXES,
) -> dict[str, jax.Array]:
    """Global ``[global_batch, length]`` arrays, batch dimension sharded over ``batch_axes``.

    Every host passes its own ``[batch_size, length]`` batch; the global batch is
    ``batch_size * jax.process_count()``. Axes of ``batch_axes`` absent from ``mesh`` are
    ignored (a mesh without ``expert`` shards over ``data`` only).

    Raises:
      ValueError: when the global batch is not divisible by the product of the batch axes.
    """
    axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    sharding = NamedSharding(mesh, PartitionSpec(axes if axes else None))
    out = {}
    for name, array in local_batch.items():
        global_batch = array.shape[0] * jax.process_count()
        if global_batch % shards:
            raise ValueError(
                f"global batch {global_batch} ({name}) is not divisible by the "
                f"{shards} devices of mesh axes {axes}"
            )
        out[name] = jax.make_array_from_process_local_data(sharding, array)
    return out
