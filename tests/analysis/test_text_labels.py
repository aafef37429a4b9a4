"""`moe-jax analyze languages` on a run trained on the user's own text with
``{label: pattern}`` groups (gin/data/text.gin): the groups are the labels, each read from
its own files; a text corpus of one pattern has no labels and is refused naming it."""

from __future__ import annotations

import json
import pathlib

import gin
import pytest

from moe_jax import cli
from moe_jax.data import labels, sources
from moe_jax.runtime import configured  # noqa: F401  (registers the gin names)

EN = [
    "All human beings are born free",
    "They are endowed with reason",
    "Everyone has the right to life",
    "No one shall be held in slavery",
    "All are equal before the law",
    "Everyone has the right to work",
]
DE = [
    "Alle Menschen sind frei geboren",
    "Jeder hat das Recht auf Leben",
    "Niemand darf gefoltert werden",
    "Alle Menschen sind vor dem Gesetz gleich",
]


def _write(path: pathlib.Path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> pathlib.Path:
    """A 1-step run on two labelled groups, 6 English and 4 German lines (plus one
    validation line each)."""
    root = tmp_path_factory.mktemp("text_labels")
    train_files = {
        "en": _write(root / "en" / "train.txt", EN),
        "de": _write(root / "de" / "train.txt", DE),
    }
    validation = {
        "en": _write(root / "en" / "val.txt", ["Everyone has duties"]),
        "de": _write(root / "de" / "val.txt", ["Jeder hat Pflichten"]),
    }
    rc = cli.main(
        [
            "train",
            "--gin_file=runs/smoke_cpu.gin",
            "--gin_file=data/text.gin",
            "--gin.BATCH_SIZE=8",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
            "--gin.TRAIN_STEPS=1",
            "--gin.train_script.train.eval_period=0",
            f"--gin.TEXT_TRAIN_FILES={train_files}",
            f"--gin.TEXT_VALIDATION_FILES={validation}",
            f"--gin.MODEL_DIR={root / 'run'}",
        ]
    )
    gin.clear_config()
    assert rc == 0
    return root / "run"


def test_text_groups_are_the_labels_each_from_its_own_files(text_run, tmp_path, capsys):
    assert (
        cli.main(
            [
                "analyze",
                "languages",
                f"--checkpoint={text_run}",
                f"--out={tmp_path}",
                "--gin.languages_script.analyze.batch_size=8",
            ]
        )
        == 0
    ), capsys.readouterr().err
    report = json.loads((tmp_path / "languages.json").read_text())
    # the run's config.gin order: gin writes dict keys sorted
    assert report["labels"] == ["de", "en"]
    assert report["num_examples"] == {"en": len(EN), "de": len(DE)}  # one example per short line
    (result,) = report["checkpoints"]
    for stats in result["layers"].values():
        assert stats["num_examples"] == len(EN) + len(DE)
        assert len(stats["top1_share"]) == 2
        assert 0.0 <= stats["bits"] <= stats["language_entropy_bits"] + 1e-9
    # the heatmap
    assert [png.read_bytes()[:4] for png in tmp_path.glob("languages_*.png")] == [b"\x89PNG"]


def test_label_groups_name_the_text_tasks(text_run):
    gin.parse_config(
        [
            "sources.make_source.corpus = 'text'",
            f"sources.make_source.train_patterns = {{'en': '{text_run.parent}/en/*.txt', "
            f"'de': '{text_run.parent}/de/*.txt'}}",
        ]
    )
    assert labels.label_groups("text_span_corruption") == {
        "en": "text_en_span_corruption",
        "de": "text_de_span_corruption",
    }
    assert labels.label_groups("mc4_prefix_lm") == {
        "en": "text_en_prefix_lm",
        "de": "text_de_prefix_lm",
    }


def test_a_text_corpus_without_groups_is_refused_naming_it(text_run, tmp_path, capsys):
    one_pattern = f"{text_run.parent}/en/train.txt"
    assert (
        cli.main(
            [
                "analyze",
                "languages",
                f"--checkpoint={text_run}",
                f"--out={tmp_path}",
                f"--gin.TEXT_TRAIN_FILES='{one_pattern}'",
                "--gin.TEXT_VALIDATION_FILES=None",
            ]
        )
        == 1
    )
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # one line
    assert "TEXT_TRAIN_FILES" in err and one_pattern in err and repr(sources.TEXT_GROUP) in err, err
    assert not (tmp_path / "languages.json").exists()
