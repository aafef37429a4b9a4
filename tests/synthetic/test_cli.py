"""The `moe-jax synthetic` command line."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest

from moe_jax import cli as moe_jax_cli
from moe_jax.synthetic import cli
from moe_jax.synthetic.experiments import EXPERIMENTS, load


def test_help_and_list_do_not_import_tensorflow():
    code = (
        "import sys; from moe_jax.synthetic import cli; cli.main(['list']); "
        "assert 'tensorflow' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == len(EXPERIMENTS)
    # one line each: the name, then its description
    for name, line in zip(EXPERIMENTS, lines, strict=True):
        assert line.split()[0] == name and len(line.split()) > 3


def test_an_experiments_help_is_its_own(capsys):
    """`moe-jax synthetic fig2 --help` describes fig2 and its presets' entries, not the
    whole command."""
    assert moe_jax_cli.main(["synthetic", "fig2", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: moe-jax synthetic fig2 [--preset quick|converged|paper]")
    assert load("fig2").description in text
    for preset, entries in load("fig2").presets.items():
        assert f"  {preset}: " + ", ".join(f"{k}={v!r}" for k, v in entries.items()) in text
    assert "positional arguments" not in text  # not `moe-jax synthetic --help`


def _synthetic(capsys, *argv: str) -> tuple[int, str]:
    """``moe-jax synthetic ARGV``'s exit code and its last line on stderr."""
    code = moe_jax_cli.main(["synthetic", *argv])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_unknown_experiment_and_bad_preset_are_named(capsys):
    code, line = _synthetic(capsys, "fig99")
    assert code == 1 and line.startswith("moe-jax synthetic: error: unknown experiment 'fig99'")
    assert _synthetic(capsys, "fig2", "--preset", "nope") == (
        1,
        "moe-jax synthetic: error: unknown preset 'nope'; choose one of quick, converged, paper",
    )


def test_bad_overrides_are_named(capsys):
    code, err = _synthetic(capsys, "fig6", "--set", "lr_routr=0.1")
    assert code == 1 and err.startswith("moe-jax synthetic: error: ")
    assert "--set lr_routr: fig6's quick preset has no such key" in err and "lr_router" in err
    code, err = _synthetic(capsys, "fig6", "--set", "sizes=1024")
    assert code == 1
    assert "sizes=1024: fig6's quick preset has sizes=[1024, 8192], a list, not a int" in err
    code, err = _synthetic(capsys, "all", "--set", "steps=10")
    assert code == 1 and "name the experiment" in err
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["fig6", "--set", "lr_router"])
    # values are literals where they parse, strings otherwise; ints stand for floats
    assert cli.apply_overrides(
        {"lr": 1e-3, "mode": "sum"}, [cli._override("lr=1"), cli._override("mode=mean")], "p"
    ) == {"lr": 1.0, "mode": "mean"}


def test_an_experiment_writes_json_csv_and_png(tmp_path, capsys):
    from moe_jax.synthetic import experiments

    preset = dict(experiments.load("spurious").presets["quick"])
    small = dict(k=4, d=20, d_signal=4, n_train=256, n_test=64, steps=100, batch=32)
    overrides = [f"--set={key}={value}" for key, value in small.items()]
    assert cli.main(["spurious", "--seeds", "0,1", "--out", str(tmp_path), *overrides]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "spurious.json").read_text())
    assert result["seeds"] == [0, 1] and result["preset"] == "quick"
    assert result["config"] == {**preset, **small}  # the preset as it ran
    # and the preset itself untouched
    assert experiments.load("spurious").presets["quick"] == preset
    with open(tmp_path / "spurious.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((int(r["seed"]), float(r["weight_decay"])) for r in rows) == [
        (0, 0.0),
        (0, 1e-3),
        (1, 0.0),
        (1, 1e-3),
    ]
    for entry in result["summary"]:  # the JSON's means are the CSV's runs averaged over seeds
        runs = [r for r in rows if float(r["weight_decay"]) == entry["weight_decay"]]
        assert entry["loss"] == pytest.approx(np.mean([float(r["loss"]) for r in runs]), rel=1e-6)
        assert entry["ratio_init"] == pytest.approx(
            np.mean([float(r["ratio_init"]) for r in runs]), rel=1e-6
        )
        assert 0 < entry["ratio_init"] < 1 and entry["steps"] == 100
        assert f"{entry['loss']:.4g}" in printed  # the console's results table
    assert plt.imread(tmp_path / "spurious.png").shape[:2] == (256, 400)  # 5 x 3.2 inches at 80 dpi
