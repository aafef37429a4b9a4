"""Per-token routing traces (`moe-jax analyze trace`): every real token's routing in every
MoE layer, as arrays (:class:`Trace`) and as Parquet files a user can open with pandas,
polars or pyarrow.

One Parquet row per token and MoE layer (:data:`SCHEMA`): the run and step, the layer, the
token's example (row of the routed data) and position, its token id and SentencePiece
piece, its example's label where the task has labels (the language of the embedded corpus,
:mod:`moe_jax.data.labels`), the layer's ``k`` choices best first (``experts``), their
router probabilities (``probs``), whether each reached its expert (``kept``; False: dropped
by the expert's capacity) and ``dropped`` (no choice kept: the token passed the layer on
the residual only). Encoder layers route the encoder input tokens; decoder layers route the
decoder input tokens (the previous target token; id 0 at position 0 starts the sequence).

The data (gin ``trace_script.collect``): the first examples of the run's task, unpacked and
unshuffled, so that every checkpoint of a run routes the same tokens in the same order (the
saturation analysis compares them token by token); for a task with labels, the first
examples of each label's task. Those settings travel with the trace (:attr:`Trace.data`, the
Parquet file's metadata), and the analyses' reports repeat them; a ``--trace`` folder whose
files were made from different data is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import errors, storage
from moe_jax.analysis import languages
from moe_jax.runtime import builders, configured, routing, run_names
from moe_jax.runtime.run_dir import RunDir

# the routed token of each stack: decoder layers read the decoder's input tokens
TOKEN_FEATURES = {"encoder": "encoder_input_tokens", "decoder": "decoder_input_tokens"}


def _schema():
    import pyarrow as pa  # deferred: only traces need it

    return pa.schema(
        [
            ("run", pa.string()),
            ("step", pa.int64()),
            ("layer", pa.string()),
            ("example", pa.int64()),
            ("position", pa.int32()),
            ("token_id", pa.int32()),
            ("piece", pa.string()),
            ("label", pa.string()),
            ("experts", pa.list_(pa.int32())),
            ("probs", pa.list_(pa.float32())),
            ("kept", pa.list_(pa.bool_())),
            ("dropped", pa.bool_()),
            ("num_experts", pa.int32()),
        ]
    )


@dataclasses.dataclass
class LayerTrace:
    """One MoE layer's routing of ``tokens`` real tokens, by example then position.

    Attributes:
      example: ``int64 [tokens]`` row of the routed data the token belongs to.
      position: ``int32 [tokens]`` position in its example (0-based).
      token_id: ``int32 [tokens]`` the routed token.
      label: ``int32 [tokens]`` index of its example's label in ``Trace.labels`` (-1: none).
      experts: ``int32 [tokens, k]`` chosen experts, best first.
      probs: ``float32 [tokens, k]`` their router probabilities.
      kept: ``bool [tokens, k]`` whether each choice reached its expert.
      num_experts: the layer's routed experts.
    """

    example: np.ndarray
    position: np.ndarray
    token_id: np.ndarray
    label: np.ndarray
    experts: np.ndarray
    probs: np.ndarray
    kept: np.ndarray
    num_experts: int

    @property
    def k(self) -> int:
        return int(self.experts.shape[1])

    @property
    def dropped(self) -> np.ndarray:
        """``bool [tokens]``: no choice reached its expert."""
        return np.logical_not(self.kept.any(axis=1))

    def same_tokens(self, other: LayerTrace) -> bool:
        """Whether ``other`` routed the same tokens in the same order."""
        return all(
            np.array_equal(getattr(self, name), getattr(other, name))
            for name in ("example", "position", "token_id")
        )


@dataclasses.dataclass
class Trace:
    """One checkpoint's per-token routing: ``layers`` by name (``"encoder/layers_1"``),
    encoder layers first, by depth; ``labels``: the task's label names (empty: none);
    ``pieces``: the piece of every token id in the trace; ``data``: the routed data's
    settings (:func:`collect`'s task, split, feature lengths, examples, labels, seed; empty
    for a file written without them)."""

    run: str
    step: int
    layers: dict[str, LayerTrace]
    labels: tuple[str, ...] = ()
    pieces: dict[int, str] = dataclasses.field(default_factory=dict)
    model_dir: str = ""  # the run's MODEL_DIR ("" when read from a file)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


# the Parquet schema metadata key of ``Trace.data`` (JSON)
DATA_KEY = b"moe_jax.trace.data"


def layer_trace(
    layer: routing.LayerRouting, token_ids: np.ndarray, row_labels: np.ndarray | None
) -> LayerTrace:
    """The real tokens of ``layer`` (``[n, length, ...]`` rows), flattened.

    Args:
      token_ids: ``int [n, length]`` the routed tokens of the layer's stack.
      row_labels: ``int [n]`` each row's label index, or None (no labels).
    """
    valid = layer.valid
    rows = np.broadcast_to(np.arange(valid.shape[0])[:, None], valid.shape)
    labels = np.full(valid.shape[0], -1) if row_labels is None else row_labels
    index = layer.expert_index[valid]
    probs = np.take_along_axis(
        layer.router_probs[valid], np.minimum(index, layer.num_experts - 1), axis=1
    )
    return LayerTrace(
        example=rows[valid].astype(np.int64),
        position=layer.positions[valid].astype(np.int32),
        token_id=np.asarray(token_ids)[valid].astype(np.int32),
        label=np.broadcast_to(labels[:, None], valid.shape)[valid].astype(np.int32),
        experts=index.astype(np.int32),
        probs=probs.astype(np.float32),
        kept=layer.kept[valid],
        num_experts=layer.num_experts,
    )


def token_pieces(vocabulary: Any, ids: np.ndarray) -> dict[int, str]:
    """``{id: piece}`` of each distinct id: the SentencePiece piece (``▁`` marks a word
    start), a sentinel's ``<extra_id_N>``, else the decoded text (byte vocabularies; an
    int vocabulary gives the id itself)."""
    ids = np.unique(ids)
    if isinstance(vocabulary, int):
        return {int(i): str(int(i)) for i in ids}
    resolved = getattr(vocabulary, "resolved", vocabulary)
    tokenizer = getattr(resolved, "tokenizer", None)
    if tokenizer is None:
        return {int(i): resolved.decode([int(i)]) for i in ids}
    size = tokenizer.get_piece_size()
    return {
        int(i): tokenizer.id_to_piece(int(i)) if i < size else resolved.decode([int(i)])
        for i in ids
    }


# --------------------------------------------------------------------------------- Parquet
def to_table(trace: Trace):
    """``trace`` as a ``pyarrow.Table`` of :data:`SCHEMA`, one row per token and layer."""
    import pyarrow as pa

    def lists(values: np.ndarray):
        flat = pa.array(values.reshape(-1))
        return pa.ListArray.from_arrays(
            pa.array(np.arange(len(values) + 1) * values.shape[1]), flat
        )

    tables = []
    for name, layer in trace.layers.items():
        n = len(layer.token_id)
        label_names = np.asarray([*trace.labels, ""], dtype=object)[layer.label]
        tables.append(
            pa.table(
                {
                    "run": pa.array([trace.run] * n, pa.string()),
                    "step": np.full(n, trace.step, np.int64),
                    "layer": pa.array([name] * n, pa.string()),
                    "example": layer.example,
                    "position": layer.position,
                    "token_id": layer.token_id,
                    "piece": pa.array([trace.pieces.get(int(i), "") for i in layer.token_id]),
                    "label": pa.array(
                        [
                            None if lab < 0 else lab_name
                            for lab, lab_name in zip(layer.label, label_names, strict=True)
                        ],
                        pa.string(),
                    ),
                    "experts": lists(layer.experts),
                    "probs": lists(layer.probs),
                    "kept": lists(layer.kept),
                    "dropped": layer.dropped,
                    "num_experts": np.full(n, layer.num_experts, np.int32),
                },
                schema=_schema(),
            )
        )
    table = pa.concat_tables(tables)
    return table.replace_schema_metadata({DATA_KEY: json.dumps(trace.data, sort_keys=True)})


def from_table(table) -> Trace:
    """The :class:`Trace` of a ``pyarrow.Table`` of one checkpoint (:func:`to_table`).

    Raises:
      ValueError: the table holds several runs or steps, or misses a column.
    """
    import pyarrow.compute as pc

    missing = [name for name in _schema().names if name not in table.column_names]
    if missing:
        raise ValueError(f"not a routing trace: the columns {missing} are missing")
    runs, steps = table["run"].unique().to_pylist(), table["step"].unique().to_pylist()
    if len(runs) != 1 or len(steps) != 1:
        raise ValueError(f"a trace holds one checkpoint; this one holds runs {runs} steps {steps}")
    label_names = sorted({v for v in table["label"].unique().to_pylist() if v is not None})
    pieces = dict(zip(table["token_id"].to_pylist(), table["piece"].to_pylist(), strict=True))
    layers = {}
    for name in sorted(table["layer"].unique().to_pylist(), key=routing.layer_order):
        part = table.filter(pc.equal(table["layer"], name))
        n = part.num_rows

        def column(key: str, dtype: Any, part=part, n=n) -> np.ndarray:
            flat = part[key].combine_chunks().flatten().to_numpy(zero_copy_only=False)
            return flat.astype(dtype).reshape(n, -1)

        labels = part["label"].to_pylist()
        layers[name] = LayerTrace(
            example=part["example"].to_numpy().astype(np.int64),
            position=part["position"].to_numpy().astype(np.int32),
            token_id=part["token_id"].to_numpy().astype(np.int32),
            label=np.asarray([-1 if v is None else label_names.index(v) for v in labels], np.int32),
            experts=column("experts", np.int32),
            probs=column("probs", np.float32),
            kept=column("kept", bool),
            num_experts=int(part["num_experts"][0].as_py()),
        )
    data = json.loads((table.schema.metadata or {}).get(DATA_KEY, b"{}"))
    return Trace(runs[0], int(steps[0]), layers, tuple(label_names), pieces, data=data)


def file_name(run: str, step: int) -> str:
    """``trace_<run>_step<N>.parquet``: the file of run label ``run``'s ``step``."""
    return f"trace_{run_names.file_stem(run)}_step{step}.parquet"


def write(trace: Trace, out_dir: str) -> str:
    """Writes ``trace`` to ``out_dir/`` :func:`file_name`; returns the path."""
    import pyarrow.parquet as pq

    path = storage.join(out_dir, file_name(trace.run, trace.step))
    with storage.writing(path) as f:
        pq.write_table(to_table(trace), f)
    return path


def read(path: str) -> Trace:
    """The :class:`Trace` of one Parquet file written by :func:`write`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return from_table(pq.read_table(pa.BufferReader(storage.read_bytes(path))))


def checkpoint_steps(checkpoint_paths: Sequence[str]) -> list[tuple[str, str, int]]:
    """``(MODEL_DIR, run label, step)`` of each checkpoint path (a bare ``MODEL_DIR``: its
    newest step), labelled as :func:`collect` labels them (``run_names.run_labels``).

    Raises:
      errors.CheckpointError: a ``MODEL_DIR`` without checkpoints.
    """
    split = [RunDir.of_checkpoint(path) for path in checkpoint_paths]
    labels = run_names.run_labels([run_dir.path for run_dir, _ in split])
    out = []
    for (run_dir, given), label in zip(split, labels, strict=True):
        step = run_dir.reached_step() if given is None else given
        if step is None:
            raise errors.CheckpointError(f"--checkpoint={run_dir.path}: no checkpoints")
        out.append((run_dir.path, label, step))
    return out


def read_folder(trace_dir: str, checkpoint_paths: Sequence[str]) -> list[Trace]:
    """The :class:`Trace` of each checkpoint path, in order, read from ``trace_dir`` (a
    folder written by :func:`analyze`) instead of routing the data again.

    Raises:
      errors.InputFileError: the folder holds no trace of one or more of the checkpoints.
    """
    wanted = checkpoint_steps(checkpoint_paths)
    paths = [storage.join(trace_dir, file_name(label, step)) for _, label, step in wanted]
    missing = [
        f"{label}@{step}"
        for (_, label, step), path in zip(wanted, paths, strict=True)
        if not storage.exists(path)
    ]
    if missing:
        held = [storage.basename(p) for p in storage.glob(trace_dir, "trace_*.parquet")]
        raise errors.InputFileError(
            f"--trace={trace_dir} holds no trace of {', '.join(dict.fromkeys(missing))} "
            f"(it holds {', '.join(held) or 'none'}); write them with `moe-jax analyze trace "
            f"--checkpoint=... --out={trace_dir}`"
        )
    read_traces = [
        dataclasses.replace(read(path), model_dir=run_dir)
        for (run_dir, _, _), path in zip(wanted, paths, strict=True)
    ]
    check_same_data(read_traces, paths)
    return read_traces


def check_same_data(read_traces: Sequence[Trace], paths: Sequence[str]) -> None:
    """Refuses traces made from different data (files without settings are not compared).

    Raises:
      errors.InputFileError: naming two files and the settings that differ.
    """
    known = [(t, p) for t, p in zip(read_traces, paths, strict=True) if t.data]
    for t, path in known[1:]:
        first, first_path = known[0]
        differ = sorted(k for k in {*t.data, *first.data} if t.data.get(k) != first.data.get(k))
        if differ:
            shown = "; ".join(f"{k}: {first.data.get(k)!r} vs {t.data.get(k)!r}" for k in differ)
            raise errors.InputFileError(
                f"--trace: {storage.basename(first_path)} and {storage.basename(path)} route "
                f"different data ({shown}); trace every compared checkpoint with the same "
                "trace_script.collect settings"
            )


# -------------------------------------------------------------------------------- collecting
def routed_examples(data: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], np.ndarray, tuple]:
    """The examples :func:`collect` routes for its settings ``data``: ``features`` (``int
    [examples, length]`` per feature), ``row_labels`` (``int [examples]``) and the label
    names (empty: the task has none, or ``use_labels`` is off)."""
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import labels as data_labels

    task = data["mixture_or_task_name"]
    groups: dict[str, str] = {"": task}
    if data["use_labels"]:
        with contextlib.suppress(data_labels.NoLabelsError):  # a task without labels
            groups = data_labels.label_groups(task)
    per_label = max(1, data["max_examples"] // len(groups))
    features, row_labels = languages.labelled_examples(
        groups, data["task_feature_lengths"], data["split"], per_label, data["seed"]
    )
    return features, row_labels, (() if list(groups) == [""] else tuple(groups))


@gin.configurable(module="trace_script", denylist=["checkpoint_paths", "all_steps"])
def collect(
    checkpoint_paths: Sequence[str],
    all_steps: bool = False,
    *,
    model: Any = gin.REQUIRED,
    mixture_or_task_name: str = gin.REQUIRED,
    task_feature_lengths: Mapping[str, int] = gin.REQUIRED,
    split: str = "train",
    max_examples: int = 256,
    batch_size: int = 64,
    use_labels: bool = True,
    seed: int = 0,
) -> Iterator[Trace]:
    """Routes the same examples through each checkpoint (every saved step of each one's
    run with ``all_steps``) and yields each one's :class:`Trace`.

    Args:
      split: the examples' split (``train``: the embedded corpus' validation split holds
        3-7 examples per language).
      max_examples: unpacked examples routed (split evenly over the labels, if any).
      use_labels: label each example when the task has labels (``moe_jax.data.labels``).
    """
    data = {
        "mixture_or_task_name": mixture_or_task_name,
        "split": split,
        "task_feature_lengths": dict(task_feature_lengths),
        "max_examples": max_examples,
        "use_labels": use_labels,
        "seed": seed,
    }
    features, row_labels, labels = routed_examples(data)
    data["examples"] = n = len(row_labels)
    input_shapes = {
        "encoder_input_tokens": (batch_size, task_feature_lengths["inputs"]),
        "decoder_input_tokens": (batch_size, task_feature_lengths["targets"]),
    }
    paths = languages.expand_checkpoints(checkpoint_paths, all_steps)
    run_dirs = [RunDir.of_checkpoint(path)[0].path for path in paths]
    run_label = dict(zip(run_dirs, run_names.run_labels(run_dirs), strict=True))
    ctx = configured.run_context()
    pieces = token_pieces(
        model.vocabulary,
        np.concatenate([features[f].ravel() for f in TOKEN_FEATURES.values()]),
    )
    fn = None
    for path, run_dir in zip(paths, run_dirs, strict=True):
        restored = builders.restore_model(path, model, input_shapes, ctx)
        if fn is None:
            fn = routing.restored_routing_fn(model, restored, ctx)
        routed = routing.collect_routing(
            fn,
            restored.params,
            languages.global_batches(features, batch_size, ctx),
            restored.collections,
        )
        layers = {
            name: layer_trace(
                layer.first_rows(n),
                features[TOKEN_FEATURES[name.split("/")[0]]],
                row_labels if labels else None,
            )
            for name, layer in routed.items()
        }
        yield Trace(run_label[run_dir], restored.step, layers, labels, pieces, run_dir, data)


def traces(
    checkpoint_paths: Sequence[str], all_steps: bool = False, trace_dir: str | None = None
) -> Iterator[Trace]:
    """Each checkpoint's :class:`Trace` (every saved step of its run with ``all_steps``):
    read from ``trace_dir`` (``--trace``: a folder of `moe-jax analyze trace`), else routed
    by :func:`collect`. The analyses of traces take their tokens' routing from here."""
    if trace_dir is None:
        return collect(checkpoint_paths, all_steps)
    paths = languages.expand_checkpoints(checkpoint_paths, all_steps)
    return iter(read_folder(storage.normalize(trace_dir), paths))


def summary_line(trace: Trace) -> str:
    """``run@step: layer tokens, dropped share; ...``."""
    parts = [
        f"{name} {len(layer.token_id)} tokens, {layer.dropped.mean():.1%} dropped"
        for name, layer in trace.layers.items()
    ]
    return f"{trace.run}@{trace.step}: " + "; ".join(parts)


def write_report(
    name: str,
    report: dict[str, Any],
    folders: Sequence[str],
    plots: Callable[[dict[str, Any], str], list[str]],
    lines: Sequence[str],
) -> None:
    """On process 0, into each of ``folders`` (``languages.output_dirs``: ``--out``, or
    each compared run's own): the PNGs of ``plots(report, folder)`` (their names go to
    ``report["files"]``) and ``<name>.json``; then ``lines`` on stdout."""
    if jax.process_index() != 0:
        return
    print("\n".join(lines), flush=True)
    for folder in folders:
        report["files"] = plots(report, folder)
        storage.write_text(storage.join(folder, f"{name}.json"), json.dumps(report, indent=1))
        print(f"[moe-jax] {name} analysis in {folder}", file=sys.stderr)


def analyze(
    checkpoint_paths: Sequence[str], out_dir: str | None = None, all_steps: bool = False
) -> list[str]:
    """`moe-jax analyze trace`: writes one Parquet file per checkpoint to ``out_dir``
    (default: its own run's ``MODEL_DIR/analysis/trace``) and returns their paths."""
    files = []
    for trace in collect(checkpoint_paths, all_steps):
        if jax.process_index() == 0:
            folder = out_dir or storage.join(RunDir(trace.model_dir).analysis_dir, "trace")
            files.append(write(trace, storage.normalize(folder)))
            print(summary_line(trace), flush=True)
    if jax.process_index() == 0:
        folders = sorted({storage.parent(f) for f in files})
        print(f"[moe-jax] routing traces in {', '.join(folders)}", file=sys.stderr)
    return files
