"""Registers the project's seqio tasks (importing this module is enough; idempotent).

Task names (usable as gin ``MIXTURE_OR_TASK_NAME``)::

    mc4_span_corruption            all languages, span corruption (T5/mT5 objective)
    mc4_<lang>_span_corruption     one language, e.g. mc4_en_span_corruption, mc4_zh_latn_...
    mc4_prefix_lm                  all languages, prefix LM (next-token continuation)
    mc4_<lang>_prefix_lm           one language

    text_span_corruption           the same objectives, named for the user's own text
    text_prefix_lm                 (gin/data/text.gin); identical to mc4_<objective>
    text_<label>_span_corruption   one group of the text corpus (make_source.train_patterns
    text_<label>_prefix_lm         {label: pattern}); registered when first asked for

``<lang>`` is the TFDS ``c4/multilingual`` split name, lower-cased, ``-`` -> ``_`` (labels
likewise). Every task reads the selected corpus
(``moe_jax.data.sources.selected_source``: the embedded UDHR corpus by default, TFDS
``c4/multilingual`` for the paper's runs, the user's files with ``corpus='text'``) and
tokenizes with ``moe_jax.data.vocab.selected_vocabulary()``. ``group_task(label)`` names the task
of one group of the selected corpus (``sources.corpus_groups()`` lists them).

Other tasks: T5X's ``MIXTURE_OR_TASK_MODULE`` names a module that registers the user's own
seqio tasks or mixtures; :func:`import_task_module` imports it before the data is read.
Each task yields ``inputs`` and ``targets`` (int32, EOS-terminated). The paper's accuracy
numbers are T5X MoE mC4 pre-training, i.e. span corruption (``DEFAULT_TASK``); see
docs/data.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence

import seqio
import tensorflow as tf

from moe_jax.data import preprocessors, sources, span_corruption
from moe_jax.data.vocab import selected_vocabulary

OBJECTIVES = {
    "span_corruption": span_corruption.span_corruption,
    "prefix_lm": preprocessors.prefix_lm,
}
DEFAULT_TASK = "mc4_span_corruption"
SHUFFLE_BUFFER_SIZE = 10_000


TEXT_PREFIX = "text"


def task_name(objective: str, language: str | None = None, prefix: str = "mc4") -> str:
    """``<prefix>[_<lang>]_<objective>`` for ``language`` (``None``: all languages)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {tuple(OBJECTIVES)}")
    lang = "" if language is None else language.lower().replace("-", "_") + "_"
    return f"{prefix}_{lang}{objective}"


class SelectedVocabulary(seqio.Vocabulary):
    """A ``seqio.Vocabulary`` that delegates every call to the current
    ``vocab.selected_vocabulary()``."""

    def __init__(self) -> None:
        super().__init__(extra_ids=0)

    @property
    def resolved(self) -> seqio.Vocabulary:
        return selected_vocabulary()

    @property
    def bos_id(self) -> int | None:
        return self.resolved.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.resolved.eos_id

    @property
    def pad_id(self) -> int:
        return self.resolved.pad_id

    @property
    def unk_id(self) -> int | None:
        return self.resolved.unk_id

    @property
    def extra_ids(self) -> int:
        return self.resolved.extra_ids

    @property
    def vocab_size(self) -> int:
        return self.resolved.vocab_size

    @property
    def _base_vocab_size(self) -> int:
        return self.resolved._base_vocab_size  # pylint: disable=protected-access

    def encode(self, s: str) -> list[int]:
        return self.resolved.encode(s)

    def decode(self, ids: Iterable[int]) -> str:
        return self.resolved.decode(ids)

    @preprocessors.plain_tf
    def encode_tf(self, s: tf.Tensor) -> tf.Tensor:
        return self.resolved.encode_tf(s)

    def decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        return self.resolved.decode_tf(ids)

    # The abstract hooks of seqio.Vocabulary; the public methods above never reach them.
    def _encode(self, s: str) -> list[int]:
        return self.encode(s)

    def _decode(self, ids: Iterable[int]) -> str:
        return self.decode(ids)

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
        return self.encode_tf(s)

    def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        return self.decode_tf(ids)

    def __eq__(self, other: object) -> bool:
        other = other.resolved if isinstance(other, SelectedVocabulary) else other
        return self.resolved == other

    def __hash__(self) -> int:
        return id(SelectedVocabulary)

    def __str__(self) -> str:
        return f"SelectedVocabulary({self.resolved})"


class CorpusSource(seqio.DataSource):
    """A ``seqio.DataSource`` delegating to ``sources.selected_source(language)`` at use
    time."""

    def __init__(self, language: str | None):
        self._language = language
        super().__init__(splits=sources.SPLITS)

    @property
    def resolved(self) -> seqio.DataSource:
        return sources.selected_source(self._language)

    @property
    def supports_arbitrary_sharding(self) -> bool:
        return self.resolved.supports_arbitrary_sharding

    def list_shards(self, split: str) -> Sequence[str]:
        return self.resolved.list_shards(split)

    def num_input_examples(self, split: str) -> int | None:
        return self.resolved.num_input_examples(split)

    def get_dataset(
        self,
        split: str = "train",
        shuffle: bool = True,
        seed: int | None = None,
        shard_info: seqio.ShardInfo | None = None,
        *,
        sequence_length: Mapping[str, int] | None = None,
        use_cached: bool = False,
        num_epochs: int | None = 1,
    ) -> tf.data.Dataset:
        return self.resolved.get_dataset(
            split=split, shuffle=shuffle, seed=seed, shard_info=shard_info
        )

    def __repr__(self) -> str:
        return f"CorpusSource(language={self._language!r})"


def output_features() -> dict[str, seqio.Feature]:
    vocabulary = SelectedVocabulary()
    return {
        "inputs": seqio.Feature(vocabulary, add_eos=True, required=False),
        "targets": seqio.Feature(vocabulary, add_eos=True),
    }


def _add_task(objective: str, language: str | None, prefix: str = "mc4") -> None:
    seqio.TaskRegistry.add(
        task_name(objective, language, prefix),
        source=CorpusSource(language),
        preprocessors=[
            preprocessors.clean_text,
            functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
            preprocessors.drop_empty_targets,
            seqio.CacheDatasetPlaceholder(),
            OBJECTIVES[objective],
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features=output_features(),
        shuffle_buffer_size=SHUFFLE_BUFFER_SIZE,
        metric_fns=[],
    )


def register_tasks() -> tuple[str, ...]:
    """Registers every (objective, language) task not registered yet; returns all names."""
    names = []
    registered = set(seqio.TaskRegistry.names())
    for objective in OBJECTIVES:
        for language in (None, *sources.mc4_languages()):
            name = task_name(objective, language)
            if name not in registered:
                _add_task(objective, language)
            names.append(name)
        name = task_name(objective, prefix=TEXT_PREFIX)
        if name not in registered:
            _add_task(objective, None, TEXT_PREFIX)
        names.append(name)
    return tuple(names)


def group_task(label: str, objective: str = "span_corruption") -> str:
    """The registered task reading only group ``label`` of the selected corpus (one of
    ``sources.corpus_groups()``): ``mc4_<lang>_<objective>`` for the embedded corpus and
    mC4, ``text_<label>_<objective>`` (registered now if new) for the text corpus."""
    groups = sources.corpus_groups()
    if label not in groups:
        raise ValueError(f"group {label!r} is not in the selected corpus; groups: {groups}")
    if label in sources.mc4_languages() and not sources.is_text_corpus():
        return task_name(objective, label)
    name = task_name(objective, label, TEXT_PREFIX)
    if name not in seqio.TaskRegistry.names():
        _add_task(objective, label, TEXT_PREFIX)
    return name


def register_group_task(name: str) -> bool:
    """Registers ``text_<label>_<objective>`` when ``name`` is one for a label of the
    selected text corpus; True when ``name`` is (now) registered."""
    if name in seqio.TaskRegistry.names():
        return True
    match = re.fullmatch(rf"{TEXT_PREFIX}_(.+)_({'|'.join(OBJECTIVES)})", name)
    if not match or not sources.is_text_corpus():
        return False
    for label in sources.corpus_groups():
        if task_name(match.group(2), label, TEXT_PREFIX) == name:
            group_task(label, match.group(2))
            return True
    return False


def reads_the_corpus(name: str) -> bool:
    """Whether task ``name`` is one of the project's, which read the selected corpus
    (``make_source``); a task of the user's own module reads what it defines."""
    if name in TASK_NAMES:
        return True
    return re.fullmatch(rf"{TEXT_PREFIX}_.+_({'|'.join(OBJECTIVES)})", name) is not None


def import_task_module(module: str | None) -> None:
    """Imports T5X's ``MIXTURE_OR_TASK_MODULE``: a module (dotted name on ``sys.path``, the
    working directory included) or a ``.py`` file that registers seqio tasks/mixtures.

    Raises:
      ValueError: naming ``MIXTURE_OR_TASK_MODULE`` when it cannot be found.
    """
    if not module:
        return
    if module.endswith(".py"):
        if not os.path.isfile(module):
            raise ValueError(f"MIXTURE_OR_TASK_MODULE={module!r}: no such file")
        name = os.path.splitext(os.path.basename(module))[0]
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == os.path.abspath(
            module
        ):
            return
        spec = importlib.util.spec_from_file_location(name, os.path.abspath(module))
        if spec is None or spec.loader is None:
            raise ValueError(f"MIXTURE_OR_TASK_MODULE={module!r}: cannot be imported")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
        return
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):
            raise ValueError(
                f"MIXTURE_OR_TASK_MODULE={module!r}: no module named {err.name!r} "
                "(put its folder on PYTHONPATH or give the .py file's path)"
            ) from None
        raise


TASK_NAMES = register_tasks()
