"""The `moe-jax synthetic` command line."""

from __future__ import annotations

import json
import subprocess
import sys

from moe_jax.synthetic import cli


def test_help_and_list_do_not_import_tensorflow():
    code = "import sys; from moe_jax.synthetic import cli; cli.main(['list']); assert 'tensorflow' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "fig2" in out.stdout


def test_unknown_experiment_and_bad_preset_are_named(capsys):
    assert cli.main(["fig99"]) == 2
    assert "unknown experiment 'fig99'" in capsys.readouterr().err
    assert cli.main(["fig2", "--preset", "huge"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err


def test_an_experiment_writes_json_csv_and_png(tmp_path, monkeypatch):
    from moe_jax.synthetic import experiments

    spec = experiments.load("spurious")
    small = dict(spec.presets["quick"], k=4, d=20, d_signal=4, n_train=256, n_test=64, steps=100, batch=32)
    monkeypatch.setitem(spec.presets, "quick", small)
    assert cli.main(["spurious", "--seeds", "0,1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "spurious.json").read_text())
    assert result["seeds"] == [0, 1]
    assert (tmp_path / "spurious.png").stat().st_size > 0 and (tmp_path / "spurious.csv").exists()
