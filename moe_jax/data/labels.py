"""Known latent clusters of a corpus: ``label -> task`` giving only that label's data.

The embedded UDHR corpus is one text in 20 languages, one file per language
(``moe_jax/data/embedded/udhr/<lang>.txt``), and the project registers a task per language
(``mc4_<lang>_<objective>``, ``moe_jax.data.tasks``); TFDS ``c4/multilingual`` likewise has
a split per language; the user's own text (``corpus='text'``, gin/data/text.gin) has one
group per label of ``make_source.train_patterns = {label: pattern}`` (task
``text_<label>_<objective>``). So a run trained on an all-group task (``mc4_<objective>``
or ``text_<objective>``) has labels for free: each label's examples come from its own
task (no language detector). The labels are ``sources.corpus_groups()`` and each label's
task ``tasks.group_task(label, objective)``. `moe-jax analyze languages` uses them
(moe_jax/analysis/languages.py).
"""

from __future__ import annotations

from moe_jax.data import sources, tasks


class NoLabelsError(ValueError):
    """The corpus or task has no per-example labels; the message names it."""


def _corpus_option() -> str:
    """``make_source.<option>=<value>`` naming the selected corpus."""
    settings = sources.make_source_settings()
    if settings["corpus"] == "tfds":
        return f"make_source.tfds_name={settings['tfds_name']!r}"
    if settings["corpus"] == "text":
        return f"make_source.train_patterns (TEXT_TRAIN_FILES)={settings['train_patterns']!r}"
    return f"make_source.corpus={settings['corpus']!r}"


def corpus_labels() -> tuple[str, ...]:
    """The group labels of the selected corpus (``sources.corpus_groups()``): languages
    of the embedded corpus and mC4, the labels of the text corpus.

    Raises:
      NoLabelsError: naming the corpus when it has fewer than two groups (a one-language
        TFDS config, a text corpus given as one pattern or list rather than
        ``{label: pattern}``).
    """
    groups = sources.corpus_groups()
    if len(groups) < 2:
        raise NoLabelsError(
            f"the corpus ({_corpus_option()}) has one group {groups[0]!r}, no labels to "
            "compare; `analyze languages` needs the embedded corpus, c4/multilingual or "
            "a text corpus of {label: pattern} groups (gin/data/text.gin)"
        )
    return groups


def label_groups(mixture_or_task_name: str) -> dict[str, str]:
    """``{label: task name}``: for each group of the run's corpus (languages, or the text
    corpus' labels), the task that yields only that group's examples, with the run's
    objective.

    Raises:
      NoLabelsError: naming ``MIXTURE_OR_TASK_NAME`` when it is not an all-group task of
        this project (a one-group task, a user mixture), or naming the corpus when it
        has no labels.
    """
    all_group = {
        tasks.task_name(o, prefix=prefix): o
        for o in tasks.OBJECTIVES
        for prefix in ("mc4", tasks.TEXT_PREFIX)
    }
    if mixture_or_task_name not in all_group:
        raise NoLabelsError(
            f"MIXTURE_OR_TASK_NAME={mixture_or_task_name!r} is not one of the "
            f"all-group tasks {sorted(all_group)}: its examples carry no labels"
        )
    return {
        label: tasks.group_task(label, all_group[mixture_or_task_name]) for label in corpus_labels()
    }
