"""T5X's MIXTURE_OR_TASK_MODULE: the user's own seqio task, registered by their module."""

from __future__ import annotations

import re

import gin
import pytest

from moe_jax.data import pipeline, tasks, vocab
from moe_jax.runtime import builders
from tests.data.span_lib import original_tokens

LENGTHS = {"inputs": 64, "targets": 16}
TEXT = "Wir sind alle frei und gleich an Wuerde und Rechten geboren."
MODULE = f"""
import functools
import seqio
import tensorflow as tf
from moe_jax.data import span_corruption, tasks

def _lines(split, shuffle_files, seed=None):
    return tf.data.Dataset.from_tensor_slices({{"targets": [{TEXT!r}] * 4}})

if "__NAME__" not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(
        "__NAME__", source=seqio.FunctionDataSource(_lines, splits=("train", "validation")),
        preprocessors=[seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
                       span_corruption.span_corruption, seqio.preprocessors.append_eos_after_trim],
        output_features=tasks.output_features(), metric_fns=[])
"""


def _first_text(task: str) -> str:
    batch = next(
        pipeline.get_dataset(
            task, LENGTHS, "train", 1, shuffle=False, seed=0, pack=False
        ).as_numpy_iterator()
    )
    return vocab.selected_vocabulary().decode(original_tokens(batch))


def test_a_py_file_registers_the_task_when_the_dataset_config_is_built(tmp_path):
    path = tmp_path / "my_tasks.py"
    path.write_text(MODULE.replace("__NAME__", "my_file_task"))
    with pytest.raises(ValueError, match="MIXTURE_OR_TASK_MODULE"):
        pipeline.get_provider("my_file_task")  # unknown before the module is imported
    builders.DatasetConfig("my_file_task", LENGTHS, module=str(path))
    assert _first_text("my_file_task") == TEXT


def test_a_module_on_the_path_through_gin(tmp_path, monkeypatch):
    (tmp_path / "lab_tasks.py").write_text(MODULE.replace("__NAME__", "lab_task"))
    monkeypatch.syspath_prepend(str(tmp_path))
    gin.parse_config("""
        MIXTURE_OR_TASK_MODULE = 'lab_tasks'
        train/utils.DatasetConfig.mixture_or_task_name = 'lab_task'
        train/utils.DatasetConfig.task_feature_lengths = {'inputs': 64, 'targets': 16}
        train/utils.DatasetConfig.module = %MIXTURE_OR_TASK_MODULE
    """)
    with gin.config_scope("train"):
        cfg = builders.DatasetConfig()
    assert cfg.module == "lab_tasks" and _first_text(cfg.mixture_or_task_name) == TEXT


def test_an_unknown_module_is_named():
    with pytest.raises(ValueError, match="MIXTURE_OR_TASK_MODULE='no_such_tasks_module'"):
        tasks.import_task_module("no_such_tasks_module")
    no_file = re.escape("MIXTURE_OR_TASK_MODULE='/nowhere/t.py': no such file")
    with pytest.raises(ValueError, match=no_file):
        tasks.import_task_module("/nowhere/t.py")


def test_the_eval_header_names_no_corpus_for_the_users_own_task(tmp_path):
    """`moe-jax eval`'s header says which corpus a project task reads; a user's own task
    reads what it defines, so none is named."""
    from moe_jax.runtime import evaluation

    path = tmp_path / "header_tasks.py"
    path.write_text(MODULE.replace("__NAME__", "header_task"))
    own = builders.DatasetConfig("header_task", LENGTHS, split="validation", module=str(path))
    assert evaluation.describe_eval_settings(2, own) == (
        "2 batches of 8 x {'inputs': 64, 'targets': 16} from the validation split of task "
        "header_task"
    )
    project = builders.DatasetConfig("mc4_span_corruption", LENGTHS, split="validation")
    assert evaluation.describe_eval_settings(2, project).endswith(
        "of task mc4_span_corruption over the embedded UDHR corpus (20 languages)"
    )
