"""Registers the project's seqio tasks (importing this module is enough; idempotent).

Task names (usable as gin ``MIXTURE_OR_TASK_NAME``)::

    mc4_span_corruption            all languages, span corruption (T5/mT5 objective)
    mc4_<lang>_span_corruption     one language, e.g. mc4_en_span_corruption, mc4_zh_latn_...
    mc4_prefix_lm                  all languages, prefix LM (next-token continuation)
    mc4_<lang>_prefix_lm           one language

``<lang>`` is the TFDS ``c4/multilingual`` split name, lower-cased, ``-`` -> ``_``. Every
task reads whatever corpus gin selects (``moe_jax.data.sources.make_source``: the embedded
UDHR corpus by default, TFDS ``c4/multilingual`` for the paper's runs) and tokenizes with
``moe_jax.data.vocab.get_vocabulary()``. Each task yields ``inputs`` and ``targets`` (int32,
EOS-terminated). The paper's accuracy numbers are T5X MoE mC4 pre-training, i.e. span
corruption (``DEFAULT_TASK``); see docs/data.md.
"""

from __future__ import annotations

import functools

import seqio

from moe_jax.data import preprocessors, sources, span_corruption
from moe_jax.data.vocab import GinVocabulary

OBJECTIVES = {
    "span_corruption": span_corruption.span_corruption,
    "prefix_lm": preprocessors.prefix_lm,
}
DEFAULT_TASK = "mc4_span_corruption"
SHUFFLE_BUFFER_SIZE = 10_000


def task_name(objective: str, language: str | None = None) -> str:
    """``mc4[_<lang>]_<objective>`` for ``language`` (``None``: all languages)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {tuple(OBJECTIVES)}")
    lang = "" if language is None else language.lower().replace("-", "_") + "_"
    return f"mc4_{lang}{objective}"


def output_features() -> dict[str, seqio.Feature]:
    vocabulary = GinVocabulary()
    return {"inputs": seqio.Feature(vocabulary, add_eos=True, required=False),
            "targets": seqio.Feature(vocabulary, add_eos=True)}


def _add_task(objective: str, language: str | None) -> None:
    seqio.TaskRegistry.add(
        task_name(objective, language),
        source=sources.CorpusSource(language),
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
    return tuple(names)


TASK_NAMES = register_tasks()
