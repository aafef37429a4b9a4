"""`moe-jax infer`: decode from a checkpoint (greedy or temperature sampling).

    moe-jax infer --checkpoint=/runs/learned --input="The quick brown <extra_id_0> jumps" \\
        [--input_file=lines.txt] [--output_file=out.jsonl] [--gin.INFER_OUTPUT_DIR=/tmp/preds]

Gin: ``runs/infer.gin``, then the run's ``MODEL_DIR/config.gin`` when no ``--gin_file`` is
given (the line ``gin config: ...`` says which), else the ``--gin_file`` files. T5X's
``--gin.CHECKPOINT_PATH`` works as ``--checkpoint``.
``infer.decode_method``, ``infer.temperature``, ``infer.max_decode_length``,
``infer.seed`` and ``infer.task_feature_lengths`` are gin bindings. Prints one line
``input -> output`` per input and, with ``--output_file``, writes JSON lines.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import errors, partitioning, storage
from moe_jax.runtime import builders, configured, distributed, gin_flags, gin_utils, run_config


def vocabulary_of(model):
    """The model's seqio vocabulary (or the project's default one)."""
    if hasattr(model.vocabulary, "encode"):
        return model.vocabulary
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import vocab

    return vocab.selected_vocabulary()


def encode_inputs(texts: Sequence[str], vocabulary, length: int, batch_multiple: int) -> np.ndarray:
    """``int32[batch, length]`` encoder tokens (EOS-terminated, zero-padded; rows added to
    a multiple of ``batch_multiple`` so the batch shards over the mesh). An input longer
    than ``length - 1`` tokens is cut to them, with a warning on stderr naming it."""
    rows = -(-len(texts) // batch_multiple) * batch_multiple
    tokens = np.zeros((rows, length), np.int32)
    for i, text in enumerate(texts):
        encoded = list(vocabulary.encode(text))
        if len(encoded) > length - 1 and jax.process_index() == 0:
            print(
                f"[moe-jax infer] warning: input {i + 1} ({text[:30]!r}...) has "
                f"{len(encoded)} tokens; only its first {length - 1} are read "
                f"(infer.task_feature_lengths['inputs'] = {length}, one for EOS)",
                file=sys.stderr,
                flush=True,
            )
        ids = [*encoded[: length - 1], vocabulary.eos_id]
        tokens[i, : len(ids)] = ids
    return tokens


def decode_outputs(tokens: np.ndarray, vocabulary) -> list[str]:
    """Token rows -> text, each cut at its first EOS."""
    out = []
    for row in np.asarray(tokens).tolist():
        ids = row[: row.index(vocabulary.eos_id)] if vocabulary.eos_id in row else row
        out.append(vocabulary.decode([t for t in ids if t > 0]))
    return out


PREDICTIONS_FILE = "predictions.jsonl"


@gin.configurable(module="infer_script", denylist=["inputs"])
def infer(
    inputs: Sequence[str],
    checkpoint_path: str | None = None,
    *,
    model: Any = gin.REQUIRED,
    task_feature_lengths: Mapping[str, int] = gin.REQUIRED,
    decode_method: str = "greedy",
    temperature: float = 1.0,
    max_decode_length: int | None = None,
    seed: int = 0,
    output_dir: str | None = None,
) -> list[str]:
    """Decodes each input text with the checkpoint's parameters and state collections
    (e.g. the bias router's ``router_bias``); returns the output texts.

    ``checkpoint_path``: ``--checkpoint`` or T5X's gin ``CHECKPOINT_PATH``; ``output_dir``
    (T5X's ``INFER_OUTPUT_DIR``): also write ``{input, output}`` JSON lines to
    ``output_dir/predictions.jsonl``.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    if not checkpoint_path:
        raise ValueError("no checkpoint: pass --checkpoint=DIR or --gin.CHECKPOINT_PATH=DIR")
    if decode_method not in ("greedy", "sample"):
        raise ValueError(f"infer.decode_method={decode_method!r}; expected 'greedy' or 'sample'")
    ctx = configured.run_context()
    vocabulary = vocabulary_of(model)
    batch_multiple = int(np.prod([ctx.mesh.shape[a] for a in ctx.batch_axes]))
    enc = encode_inputs(inputs, vocabulary, task_feature_lengths["inputs"], batch_multiple)
    dec_len = max_decode_length or task_feature_lengths["targets"]
    input_shapes = {
        "encoder_input_tokens": enc.shape,
        "decoder_input_tokens": (enc.shape[0], dec_len),
    }
    restored = builders.restore_model(checkpoint_path, model, input_shapes, ctx)
    batch_sharding = NamedSharding(ctx.mesh, PartitionSpec(ctx.batch_axes))
    batch = {"encoder_input_tokens": jax.device_put(enc, batch_sharding)}

    @jax.jit
    def predict(params, collections, batch, rng):
        return model.predict_batch(
            params,
            batch,
            rng,
            decode_method=decode_method,
            temperature=temperature,
            max_decode_length=dec_len,
            state=collections,
        )

    with partitioning.activate(ctx.mesh, ctx.rules):
        tokens = predict(restored.params, restored.collections, batch, jax.random.PRNGKey(seed))
    from jax.experimental import multihost_utils

    tokens = np.asarray(multihost_utils.process_allgather(tokens, tiled=True))
    outputs = decode_outputs(tokens, vocabulary)[: len(inputs)]
    if output_dir and jax.process_index() == 0:
        write_predictions(storage.join(output_dir, PREDICTIONS_FILE), inputs, outputs)
    return outputs


def write_predictions(path: str, inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """``{"input", "output"}`` JSON lines (written whole; local or ``gs://``)."""
    storage.write_text(
        path,
        "".join(
            json.dumps({"input": text, "output": out}) + "\n"
            for text, out in zip(inputs, outputs, strict=True)
        ),
    )


def read_input_lines(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file.

    Raises:
      InputFileError: naming ``--input_file`` when it is missing, unreadable or not UTF-8.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except UnicodeDecodeError as err:
        raise errors.InputFileError(
            f"--input_file={path}: not UTF-8 text (byte {err.start}: {err.reason})"
        ) from None
    except OSError as err:
        raise errors.InputFileError(f"--input_file={path}: {err.strerror or err}") from None


def main(argv: list[str] | None = None) -> int:
    parser = builders.build_parser("moe-jax infer", __doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        type=storage.normalize,
        default=None,
        metavar="DIR[/STEP]",
        help="a MODEL_DIR (latest step) or MODEL_DIR/STEP (or gin CHECKPOINT_PATH)",
    )
    parser.add_argument("--input", action="append", default=[], help="input text (repeatable)")
    parser.add_argument("--input_file", default=None, help="one input per line")
    parser.add_argument(
        "--output_file", type=storage.normalize, default=None, help="JSON lines {input, output}"
    )
    args = gin_flags.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    inputs = list(args.input) + (read_input_lines(args.input_file) if args.input_file else [])
    if not inputs:
        parser.error("give at least one --input or an --input_file")
    distributed.initialize(args)
    args.gin_file = run_config.run_gin_files(
        args, gin_flags.first_checkpoint(args), ["runs/infer.gin"], command="moe-jax infer"
    )
    gin_utils.parse_gin(args)
    outputs = infer(
        inputs,
        output_dir=gin_flags.user_value(args, "INFER_OUTPUT_DIR"),  # never the run's config's
        **({"checkpoint_path": args.checkpoint} if args.checkpoint else {}),
    )
    if jax.process_index() == 0:
        for text, out in zip(inputs, outputs, strict=True):
            print(f"{text} -> {out}")
        if args.output_file:
            write_predictions(args.output_file, inputs, outputs)
    return 0
