"""Known latent clusters of a corpus: ``label -> task`` giving only that label's data.

The embedded UDHR corpus is one text in 20 languages, one file per language
(``moe_jax/data/embedded/udhr/<lang>.txt``), and the project registers a task per language
(``mc4_<lang>_<objective>``, ``moe_jax.data.tasks``); TFDS ``c4/multilingual`` likewise has
a split per language. So a run trained on the all-language task ``mc4_<objective>`` has
language labels for free: each label's examples come from its own task (no language
detector). `moe-jax analyze languages` uses them (moe_jax/analysis/languages.py).
"""

from __future__ import annotations

import gin

from moe_jax.data import sources, tasks


class NoLabelsError(ValueError):
    """The corpus or task has no per-example labels; the message names it."""


def _bound_corpus() -> tuple[str, str]:
    """(``make_source.corpus``, ``make_source.tfds_name``) as gin binds them."""
    bindings = gin.get_bindings(sources.make_source)
    return (bindings.get("corpus", "embedded"), bindings.get("tfds_name", "c4/multilingual:3.1.0"))


def corpus_labels() -> tuple[str, ...]:
    """The languages of the corpus gin selects (``make_source.corpus``).

    Raises:
      NoLabelsError: naming the corpus when it has no per-language structure.
    """
    corpus, tfds_name = _bound_corpus()
    if corpus == "embedded":
        return sources.embedded_languages()
    if corpus == "tfds" and tfds_name.startswith("c4/multilingual"):
        return sources.mc4_languages()
    what = f"tfds_name={tfds_name!r}" if corpus == "tfds" else f"corpus={corpus!r}"
    raise NoLabelsError(f"the corpus (make_source.{what}) has no language labels; "
                        "`analyze languages` needs the embedded corpus or c4/multilingual")


def label_groups(mixture_or_task_name: str) -> dict[str, str]:
    """``{label: task name}``: for each language of the run's corpus, the task that yields
    only that language's examples, with the run's objective.

    Raises:
      NoLabelsError: naming ``MIXTURE_OR_TASK_NAME`` when it is not an all-language task
        of this project (a one-language task, a user mixture), or naming the corpus when it
        has no language labels.
    """
    for objective in tasks.OBJECTIVES:
        if mixture_or_task_name == tasks.task_name(objective):
            return {label: tasks.task_name(objective, label) for label in corpus_labels()}
    raise NoLabelsError(f"MIXTURE_OR_TASK_NAME={mixture_or_task_name!r} is not one of the "
                        f"all-language tasks {[tasks.task_name(o) for o in tasks.OBJECTIVES]}: "
                        "its examples carry no language labels")
