"""`moe-jax analyze positions` end to end on a tiny trained checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_jax import cli as moe_jax_cli
from moe_jax.commands import analyze

LAYERS = ["encoder/layers_1", "decoder/layers_1"]  # size_tiny: one sparse layer per stack


@pytest.fixture(scope="module")
def analysis(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("positions")
    rc = analyze.main(
        [
            "positions",
            f"--checkpoint={tiny_run}/checkpoints/1",
            f"--out={out}",
            "--gin.positions_script.analyze.num_batches=2",
            "--gin.positions_script.analyze.block_sizes=(4, 16)",
        ]
    )
    assert rc == 0
    return out, json.loads((out / "positions.json").read_text())


def test_cli_writes_the_json_and_the_pngs(analysis):
    out, result = analysis
    assert result["step"] == 1 and list(result["layers"]) == LAYERS
    assert result["dataset"]["split"] == "validation" and result["settings"]["num_batches"] == 2
    expected = {f"activation_{name.replace('/', '_')}.png" for name in LAYERS}
    expected |= {"correlation_length.png", "probe_accuracy.png", "drops_by_position.png"}
    assert set(result["files"]) == expected
    for name in expected:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    enc, dec = (result["layers"][n] for n in LAYERS)
    assert len(enc["activation_rate"]["top_k"]) <= 32 and len(dec["activation_rate"]["top_k"]) <= 8
    assert enc["num_sequences"] == 16 and enc["k"] == 2 and enc["num_experts"] == 4
    assert set(enc["probe"]) == {"parity", "block_4", "block_16"} and set(dec["probe"]) == {
        "parity",
        "block_4",
    }
    for stats in result["layers"].values():
        for probe in stats["probe"].values():
            assert 0.0 <= probe["accuracy"] <= 1.0 and probe["test_tokens"] > 0
        for which in ("model", "shuffled"):
            c = stats["correlation"][which]
            assert c["xi_int"] >= 1.0 and c["xi_domain"] >= 1.0 and len(c["rho"]) == 16
            consecutive = stats["consecutive"][which]
            assert consecutive["topk_overlap"] >= consecutive["top1_repeat"]
        # the lag-1 same-expert share is the first point of p_same (the shuffles differ)
        p_same = stats["correlation"]["model"]["p_same"][0]
        assert stats["consecutive"]["model"]["top1_repeat"] == pytest.approx(p_same)
        drops = stats["drop_rate"]
        assert len(drops["choices"]) == len(stats["activation_rate"]["tokens_per_position"])
        tokens = np.asarray(stats["activation_rate"]["tokens_per_position"])
        assert np.dot(drops["choices"], tokens) / tokens.sum() == pytest.approx(
            drops["overall_choices"]
        )


def test_activation_rates_sum_to_k_at_every_position(analysis):
    _, result = analysis
    for stats in result["layers"].values():
        tokens = np.asarray(stats["activation_rate"]["tokens_per_position"])
        seen = tokens > 0
        assert seen[0] and tokens.sum() == stats["num_tokens"]
        np.testing.assert_allclose(
            np.sum(stats["activation_rate"]["top_k"], 1)[seen], stats["k"], rtol=1e-9
        )
        np.testing.assert_allclose(
            np.sum(stats["activation_rate"]["top1"], 1)[seen], 1.0, rtol=1e-9
        )


def test_bad_checkpoint_path_is_named(tmp_path, tiny_run, capsys):
    missing = tmp_path / "no_such_run"
    assert (
        moe_jax_cli.main(
            ["analyze", "positions", f"--checkpoint={missing}/checkpoints/5", f"--out={tmp_path}"]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert f"--checkpoint='{missing}/checkpoints/5'" in err and "does not exist" in err
    assert (
        moe_jax_cli.main(
            ["analyze", "positions", f"--checkpoint={tiny_run}/checkpoints/7", f"--out={tmp_path}"]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "no checkpoint step 7" in err and str(tiny_run) in err and "[1]" in err
    assert not (tmp_path / "positions.json").exists()


def test_unknown_analysis_is_refused(capsys):
    assert analyze.main(["nonsense"]) == 2
    assert "unknown analysis 'nonsense'" in capsys.readouterr().err
