"""`moe-jax sweep`: family expansion, refusal of bad family files, the collection of eval
curves into paired gaps and plots, and one real run of a two-run family."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys

import matplotlib.image
import numpy as np
import pytest

from moe_jax import cli
from moe_jax.experiments import sweep
from moe_jax.runtime.run_spec import RunSpec

REPO = pathlib.Path(__file__).resolve().parents[2]


def write_family(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "family.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_families_expand_to_distinct_runs_with_existing_gin_files(path):
    family = sweep.load_family(str(path))
    dirs = [spec.model_dir("/root") for spec in family.runs]
    assert len(set(dirs)) == len(dirs)
    for spec in family.runs:
        for gin_file in spec.gin_files:
            assert (REPO / "gin" / gin_file).is_file(), f"{path.name}: {gin_file}"


def test_family_is_the_product_of_runs_axes_and_seeds(tmp_path):
    family = sweep.load_family(
        write_family(
            tmp_path,
            """
name = "f7"
gin_files = ["experiments/cpu_scale.gin"]
seeds = [3, 4]
[bindings]
TRAIN_STEPS = 10
[axes]
NUM_EXPERTS = [8, 16, 32]
[runs.frozen]
gin_files = ["experiments/fig5_frozen.gin"]
[runs.learned]
gin_files = ["experiments/fig5_learned.gin"]
bindings = {TRAIN_STEPS = 20, "router_mode.mode" = "learned"}
""",
        )
    )
    assert len(family.runs) == 2 * 3 * 2
    spec = next(
        s
        for s in family.runs
        if s.run == "learned" and dict(s.axes)["NUM_EXPERTS"] == 16 and s.seed == 4
    )
    assert spec.model_dir("/r") == "/r/learned/NUM_EXPERTS-16/seed4"
    cmd = spec.command("/r")
    assert cmd[:4] == [
        "moe-jax",
        "train",
        "--gin_file=experiments/fig5_learned.gin",
        "--gin_file=experiments/cpu_scale.gin",
    ]  # the family's overlay comes last
    assert (
        "--gin.TRAIN_STEPS=20" in cmd and "--gin.TRAIN_STEPS=10" not in cmd
    )  # run overrides family
    assert "--gin.router_mode.mode='learned'" in cmd
    assert "--gin.NUM_EXPERTS=16" in cmd and "--gin.RANDOM_SEED=4" in cmd
    assert "--gin.MODEL_DIR=/r/learned/NUM_EXPERTS-16/seed4" in cmd


@pytest.mark.parametrize(
    "text, match",
    [
        (
            'seeds = [0]\n[runs.a]\ngin_files = ["x.gin"]\nstep = 3\n',
            r"unknown key\(s\) \['step'\]",
        ),
        ("[runs.a]\nbindings = {}\n", r"runs\.a\.gin_files is missing"),
        (
            '[runs.a]\ngin_files = ["x.gin"]\ngin_file = "y"\n',
            r"runs\.a: unknown key\(s\) \['gin_file'\]",
        ),
        ('seeds = "0,1"\n[runs.a]\ngin_files = ["x.gin"]\n', r"'seeds' must be a non-empty list"),
        (
            '[axes]\nNUM_EXPERTS = []\n[runs.a]\ngin_files = ["x.gin"]\n',
            r"axes\.NUM_EXPERTS must be a non-empty list",
        ),
        ('name = "x"\n', r"needs at least one \[runs\.<name>\]"),
        ("[runs.a\n", r"not valid TOML"),
        ('[runs.".."]\ngin_files = ["x.gin"]\n', r"run name '\.\.' must be one folder name"),
        (
            '[axes]\nNUM_EXPERTS = ["8/../../../elsewhere"]\n[runs.a]\ngin_files = ["x.gin"]\n',
            r"axes\.NUM_EXPERTS value '8/\.\./\.\./\.\./elsewhere' must be one folder name",
        ),
    ],
)
def test_bad_family_files_are_refused_naming_file_and_key(tmp_path, text, match):
    path = write_family(tmp_path, text)
    with pytest.raises(sweep.FamilyError, match=match) as err:
        sweep.load_family(path)
    assert str(err.value).startswith(path)


def test_missing_or_bad_family_file_is_one_error_line(tmp_path, capsys):
    assert cli.main(["sweep", "collect", str(tmp_path / "nope.toml"), "--root", str(tmp_path)]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(
            f"moe-jax sweep: error: {tmp_path / 'nope.toml'}: no such family file (looked in the "
            "working directory and "
        )
    )
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)))
    assert cli.main(["sweep", "run", str(binary), "--root", str(tmp_path)]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(f"moe-jax sweep: error: {binary}: not valid TOML (")
    )
    bad = write_family(tmp_path, "this is = = bad\n")
    assert cli.main(["sweep", "run", bad, "--root", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"moe-jax sweep: error: {bad}: not valid TOML (Expected '=' after a key in a key/value "
        "pair (at line 1, column 6))"
    )


def test_a_shipped_family_file_is_found_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    family = sweep.load_family("configs/fig7_cpu.toml")
    assert family.name == "fig7_cpu" and len(family.runs) == 8


def write_eval_records(model_dir: str, curve: dict[int, float]) -> None:
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "metrics.jsonl"), "a") as f:
        f.write(
            json.dumps({"step": 1, "split": "train", "accuracy": 0.99}) + "\n"
        )  # not eval: ignored
        for step, value in curve.items():
            f.write(
                json.dumps({"step": step, "split": "eval", "accuracy": value, "loss": 1.0}) + "\n"
            )


def test_collect_gives_seed_statistics_paired_gaps_and_plots(tmp_path):
    path = write_family(
        tmp_path,
        """
name = "fam"
seeds = [0, 1, 2]
[axes]
NUM_EXPERTS = [8, 16]
[runs.frozen]
gin_files = ["a.gin"]
[runs.learned]
gin_files = ["b.gin"]
""",
    )
    family = sweep.load_family(path)
    root = str(tmp_path / "runs")
    rng = np.random.default_rng(0)
    finals = {}
    for spec in family.runs:
        values = rng.uniform(0.2, 0.6, size=3)
        steps = [100, 200, 300] if spec.seed != 2 else [100, 200, 300, 400]  # seed 2 ran further
        curve = dict(zip(steps, [*values, 0.9][: len(steps)], strict=True))
        write_eval_records(spec.model_dir(root), curve)
        finals[(spec.group, spec.seed)] = curve[300]
    # a resumed run re-evaluates step 300: the later record wins
    resumed = family.runs[0]
    write_eval_records(resumed.model_dir(root), {300: 0.75})
    finals[(resumed.group, resumed.seed)] = 0.75

    summary = sweep.summarize(family, root)
    group = summary["groups"]["learned/NUM_EXPERTS-16"]
    assert group["steps"] == [100, 200, 300]  # only the steps every seed reached
    expected = np.array([finals[("learned/NUM_EXPERTS-16", s)] for s in range(3)])
    assert group["final_stats"]["mean"] == pytest.approx(expected.mean())
    assert group["final_stats"]["std"] == pytest.approx(expected.std(ddof=1))
    assert group["curve"]["max"][-1] == pytest.approx(expected.max())

    gaps = {(g["a"], g["b"]): g for g in summary["gaps"]}
    assert set(gaps) == {
        ("learned/NUM_EXPERTS-8", "frozen/NUM_EXPERTS-8"),
        ("learned/NUM_EXPERTS-16", "frozen/NUM_EXPERTS-16"),
    }  # same axis point only
    diff = np.array(
        [
            finals[("learned/NUM_EXPERTS-8", s)] - finals[("frozen/NUM_EXPERTS-8", s)]
            for s in range(3)
        ]
    )
    gap = gaps[("learned/NUM_EXPERTS-8", "frozen/NUM_EXPERTS-8")]
    assert gap["mean"] == pytest.approx(diff.mean()) and gap["std"] == pytest.approx(
        diff.std(ddof=1)
    )
    assert gap["a_higher"] == int((diff > 0).sum())

    out = tmp_path / "out"
    assert sweep.main(["collect", path, "--root", root, "--out", str(out)]) == 0
    assert json.loads((out / "fam.json").read_text())["gaps"]
    for png in ["fam_curves.png", "fam_vs_NUM_EXPERTS.png"]:
        image = matplotlib.image.imread(out / png)
        assert image.ndim == 3 and image.shape[0] > 100
    assert sweep.main(["collect", path, "--root", root, "--out", str(out), "--metric", "loss"]) == 0
    by_loss = json.loads((out / "fam_loss.json").read_text())
    assert (
        by_loss["metric"] == "loss"
        and by_loss["groups"]["frozen/NUM_EXPERTS-8"]["final_stats"]["mean"] == 1.0
    )
    assert (out / "fam_loss_curves.png").exists()


def test_collect_without_any_eval_record_fails_clearly(tmp_path, capsys):
    path = write_family(tmp_path, '[runs.a]\ngin_files = ["x.gin"]\n')
    assert cli.main(["sweep", "collect", path, "--root", str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().err.startswith("moe-jax sweep: error: no eval records under")


TINY_FAMILY = """
name = "tiny"
seeds = [0]
[bindings]
TRAIN_STEPS = 2
BATCH_SIZE = 8
TASK_FEATURE_LENGTHS = {inputs = 32, targets = 8}
"train_script.train.eval_period" = 2
"train_script.train.eval_steps" = 1
"train_script.train.checkpoint_period" = 2
[runs.learned]
gin_files = ["runs/smoke_cpu.gin"]
[runs.frozen]
gin_files = ["runs/smoke_cpu.gin", "routers/frozen.gin"]
"""


FAKE_TRAINER = """
import json, os, sys
model_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--gin.MODEL_DIR="))
print("step 2/2: loss 1.0000", flush=True)
with open(os.path.join(model_dir, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 2, "split": "eval", "accuracy": 0.5}) + "\\n")
"""


def test_run_echoes_progress_and_collect_sees_what_set_changed(tmp_path, capsys, monkeypatch):
    """`sweep run --set seeds=[5]` records the resolved family; `collect` without the --set
    collects seed 5 (and does not list seed 0, which never ran). Each run's output reaches
    the sweep's stdout, prefixed with the run, and its log.txt."""
    path = write_family(tmp_path, '[runs.learned]\ngin_files = ["x.gin"]\n')
    root = str(tmp_path / "runs")
    fake = functools.partial(sweep.run_family, executable=(sys.executable, "-c", FAKE_TRAINER))
    monkeypatch.setattr(sweep, "run_family", fake)
    assert sweep.main(["run", path, "--root", root, "--set", "seeds=[5]"]) == 0
    assert "[sweep learned seed 5] step 2/2: loss 1.0000" in capsys.readouterr().out
    assert "step 2/2" in pathlib.Path(root, "learned", "seed5", "log.txt").read_text()
    assert sweep.main(["collect", path, "--root", root]) == 0
    summary = json.loads(pathlib.Path(root, "family.json").read_text())
    assert list(summary["groups"]) == ["learned"]
    assert summary["groups"]["learned"]["final"] == {"5": 0.5}


@pytest.mark.slow  # two subprocess trainings: ~1.5 min on an idle 2-core machine
def test_run_trains_each_run_once_then_collect_plots_them(tmp_path, capsys):
    path = write_family(tmp_path, TINY_FAMILY)
    root = str(tmp_path / "runs")
    assert sweep.main(["run", path, "--root", root, "--parallel", "2"]) == 0
    for run in ("learned", "frozen"):
        model_dir = pathlib.Path(root, run, "seed0")
        assert (model_dir / "DONE").exists() and (model_dir / "checkpoints" / "2").is_dir()
        assert RunSpec.from_json((model_dir / "run.json").read_text()).router_mode == run
    capsys.readouterr()
    assert sweep.main(["run", path, "--root", root]) == 0  # everything DONE: nothing runs
    assert "0 to run" in capsys.readouterr().out
    assert sweep.main(["collect", path, "--root", root]) == 0
    summary = json.loads(pathlib.Path(root, "tiny.json").read_text())
    assert [g["final_step"] for g in summary["groups"].values()] == [2, 2]
    assert (
        summary["gaps"][0]["a"] == "frozen" and summary["gaps"][0]["b"] == "learned"
    )  # file order


def test_set_and_gin_flags_change_the_family_without_editing_it(tmp_path, capsys):
    """A family tried small: --set steps / seeds / a table key / a run's binding and
    --gin.NAME=VALUE reach every run's train command (after the family's bindings, so they
    win); the file is unchanged."""
    path = REPO / "configs" / "fig5_cpu.toml"
    before = path.read_text()
    argv = [
        "run",
        str(path),
        f"--root={tmp_path}",
        "--dry-run",
        "--set",
        "steps=20",
        "--set",
        "seeds=[5]",
        "--set",
        "bindings.train_script.train.eval_period=10",
        "--set",
        "runs.frozen.bindings.NUM_EXPERTS=8",
        "--gin.BATCH_SIZE=8",
        "--gin.TRAIN_STEPS=30",
    ]
    assert sweep.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and path.read_text() == before
    for line in lines:
        flags = line.split()
        assert flags.index("--gin.TRAIN_STEPS=20") < flags.index(
            "--gin.TRAIN_STEPS=30"
        )  # the flag wins
        assert "--gin.train_script.train.eval_period=10" in flags and "--gin.BATCH_SIZE=8" in flags
        assert "--gin.RANDOM_SEED=5" in flags and f"--gin.MODEL_DIR={tmp_path}" in " ".join(flags)
        assert ("--gin.NUM_EXPERTS=8" in flags) == ("fig5_frozen.gin" in line)
    family = sweep.load_family(str(path), [("seeds", [0, 1]), ("axes.NUM_EXPERTS", [8, 16])])
    assert sorted({(s.seed, dict(s.axes)["NUM_EXPERTS"]) for s in family.runs}) == [
        (0, 8),
        (0, 16),
        (1, 8),
        (1, 16),
    ]


@pytest.mark.parametrize(
    "sets, match",
    [
        ([("stepz", 3)], r"--set stepz: no family key 'stepz'"),
        ([("runs.nope.bindings.X", 1)], r"no run 'nope'; runs: \['dense', 'frozen', 'learned'\]"),
        ([("seeds", "zero")], r"'seeds' must be a non-empty list of integers"),
        ([("runs.dense.other", 1)], r"runs.dense.gin_files or runs.dense.bindings.NAME"),
    ],
)
def test_bad_set_is_refused_naming_it(sets, match):
    with pytest.raises(sweep.FamilyError, match=match):
        sweep.load_family(str(REPO / "configs" / "fig5_cpu.toml"), sets)


def test_gin_flags_belong_to_run_only(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.main(
            ["collect", str(REPO / "configs" / "fig5_cpu.toml"), f"--root={tmp_path}", "--gin.X=1"]
        )
    assert "--gin.NAME=VALUE is a flag of `sweep run`" in capsys.readouterr().err
