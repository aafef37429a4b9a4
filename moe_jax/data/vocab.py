"""Vocabularies.

``get_vocabulary(kind, path, extra_ids)`` is the single place the project decides which
vocabulary it uses:

* ``kind="embedded"`` (default): the SentencePiece model committed under
  ``moe_jax/data/embedded/udhr_spm.model`` (8000 pieces) plus ``extra_ids`` sentinels.
* ``kind="sentencepiece"``: any SentencePiece model by local path or URL (``gs://...``),
  e.g. the mT5 vocabulary ``gs://t5-data/vocabs/mc4.250000.100extra/sentencepiece.model``
  (whose 100 sentinels are already pieces of the model: bind ``extra_ids = 0``).
* ``kind="byte"``: ``seqio.ByteVocabulary`` (no file at all).

The vocabulary the tasks tokenize with is :func:`selected_vocabulary`: the one
:func:`select_vocabulary` was given (the front door, :mod:`moe_jax.runtime.configured`,
selects ``get_vocabulary`` with gin's ``vocab.get_vocabulary.*`` bindings, or a recorded
run's ``model.vocabulary``).
Tasks are registered at import time, before gin files are parsed, so their features hold
a ``tasks.SelectedVocabulary``: a ``seqio.Vocabulary`` that resolves
:func:`selected_vocabulary` on each use. This module reads no gin and imports seqio and
TensorFlow only when a vocabulary is loaded, so gin files that configure it can be parsed
where only the model is needed.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from moe_jax import storage
from moe_jax.errors import InputFileError

if TYPE_CHECKING:
    import seqio

EMBEDDED_SPM = pathlib.Path(__file__).resolve().parent / "embedded" / "udhr_spm.model"
MT5_SPM = "gs://t5-data/vocabs/mc4.250000.100extra/sentencepiece.model"
KINDS = ("embedded", "sentencepiece", "byte")
# What a refused read of a gs:// file says: the paper-scale configs need Google Cloud access.
CLOUD_HINT = (
    "; the paper-scale experiments read mC4 and the mT5 vocabulary from Google Cloud "
    "Storage: without access, add --gin_file=experiments/cpu_scale.gin (the embedded corpus "
    "and vocabulary)"
)


@functools.lru_cache(maxsize=16)
def _load(kind: str, path: str | None, extra_ids: int) -> seqio.Vocabulary:
    import seqio  # deferred: parsing gin needs neither seqio nor TensorFlow
    import tensorflow as tf

    if kind not in KINDS:
        raise ValueError(f"get_vocabulary.kind={kind!r} is not one of {KINDS}")
    if kind == "byte":
        if extra_ids <= 0:
            raise ValueError(
                "get_vocabulary.kind='byte' needs extra_ids > 0 (span-corruption "
                f"sentinels), got get_vocabulary.extra_ids={extra_ids}"
            )
        return seqio.ByteVocabulary(extra_ids=extra_ids)
    if kind == "embedded":
        path = str(EMBEDDED_SPM) if path is None else path
    if not path:
        raise ValueError(
            f"get_vocabulary.kind='sentencepiece' needs get_vocabulary.path (e.g. {MT5_SPM!r})"
        )
    try:
        found = tf.io.gfile.exists(path)
    except tf.errors.OpError as err:  # no network, no credentials, a host not resolved
        cause = (str(err.message).strip().splitlines() or [""])[0][:200]
        raise InputFileError(
            f"cannot read the SentencePiece model get_vocabulary.path={path!r} ({cause})"
            + (CLOUD_HINT if storage.gcs_bucket(path) is not None else "")
        ) from None
    if not found:
        raise InputFileError(
            f"SentencePiece model not found: get_vocabulary.path={path!r} (kind={kind!r})"
        )
    return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


def get_vocabulary(
    kind: str = "embedded", path: str | None = None, extra_ids: int = 100
) -> seqio.Vocabulary:
    """The project's vocabulary (cached per arguments).

    Args:
      kind: ``"embedded"``, ``"sentencepiece"`` or ``"byte"`` (see the module docstring).
      path: SentencePiece model file or URL; required for ``"sentencepiece"``, optional
        override for ``"embedded"``; ignored for ``"byte"``.
      extra_ids: sentinel ids appended after the model's pieces (the last id is
        ``<extra_id_0>``).

    Raises:
      FileNotFoundError: naming ``get_vocabulary.path`` when the model file is missing.
      ValueError: naming the option for an unknown ``kind`` or a missing ``path``.
    """
    return _load(kind, path, extra_ids)


# The provider of the selected vocabulary (select_vocabulary); none selected: the default.
_SELECTED: list[Callable[[], seqio.Vocabulary]] = [get_vocabulary]


def select_vocabulary(provider: Callable[[], seqio.Vocabulary]) -> None:
    """Makes ``provider`` (called at each use) the vocabulary of
    :func:`selected_vocabulary`."""
    _SELECTED[0] = provider


def selected_vocabulary() -> seqio.Vocabulary:
    """The selected vocabulary (:func:`select_vocabulary`; default: ``get_vocabulary()``)."""
    return _SELECTED[0]()
