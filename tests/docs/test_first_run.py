"""The README's "A first run" block, run as written (fewer steps, a temporary folder for
``/tmp``), and the default output folders that keep its commands apart."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from moe_jax.runtime import run_names

REPO = pathlib.Path(__file__).resolve().parents[2]


def first_run_commands(readme: str) -> list[list[str]]:
    """The commands of the README's ``## A first run`` code block, one argv each (``\\``
    continuations joined, ``#`` comments dropped)."""
    section = readme.split("## A first run", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md: no bash block under '## A first run'"
    text = block.group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]


def test_comparison_folders_are_named_by_what_is_compared():
    assert run_names.comparison_folder(["learned", "frozen"]) == "learned+frozen"
    assert run_names.comparison_folder(["learned"]) == "learned"
    assert (
        run_names.comparison_folder(["learned"], ["learned", "random", "hash"])
        == "learned.routers-learned+random+hash"
    )
    assert run_names.comparison_folder(["learned/seed0", "frozen/seed0"]) == (
        "learned_seed0+frozen_seed0"
    )
    assert run_names.comparison_folder([".."]) == "_.."
    many = [f"learned/NUM_EXPERTS-8/seed{i}" for i in range(9)]
    name = run_names.comparison_folder(many)
    assert len(name) <= 120 and name.startswith("learned_NUM_EXPERTS-8_seed0+8_more-")
    assert name != run_names.comparison_folder([*many[:8], "other"])


@pytest.mark.slow
def test_the_readme_first_run_block_runs_as_written(tmp_path):
    commands = first_run_commands((REPO / "README.md").read_text())
    assert [c[:2] for c in commands] == [
        ["moe-jax", "train"],
        ["moe-jax", "train"],
        ["moe-jax", "eval"],
        ["moe-jax", "eval"],
        ["moe-jax", "analyze"],
        ["moe-jax", "synthetic"],
    ]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    work = tmp_path / "work"  # a new user's working directory, outside the repository
    work.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for command in commands:
        argv = [a.replace("/tmp/", f"{scratch}/") for a in command]
        argv = [re.sub(r"^--gin.TRAIN_STEPS=\d+$", "--gin.TRAIN_STEPS=3", a) for a in argv]
        done = subprocess.run(
            [sys.executable, "-m", "moe_jax.cli", *argv[1:]],
            check=False,
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, (argv, done.stderr[-3000:])
    results = scratch / "learned" / "eval_results"
    both = json.loads((results / "learned+frozen" / "comparison.json").read_text())
    assert list(both) == ["learned", "frozen"]
    routers = results / "learned.routers-learned+random+hash" / "comparison.json"
    assert list(json.loads(routers.read_text())) == [
        "learned:learned",
        "learned:random",
        "learned:hash",
    ]
    for run in ("learned", "frozen"):  # the language analysis of both runs, in each
        assert (scratch / run / "analysis" / "learned+frozen" / "languages.json").exists()
    assert (scratch / "fig2").is_dir() and any((scratch / "fig2").glob("*.png"))
