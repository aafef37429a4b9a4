"""`moe-jax eval --router` and `moe-jax analyze languages` end to end on the tiny checkpoint."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moe_jax import cli as moe_cli
from moe_jax import errors, plotting
from moe_jax.analysis import languages
from moe_jax.commands import evaluate
from moe_jax.data import sources
from moe_jax.runtime import run_names
from tests.analysis.conftest import TINY

LAYERS = ["encoder/layers_1", "decoder/layers_1"]


def _eval(run, out, *routers):
    return moe_cli.main(
        [
            "eval",
            *TINY,
            f"--checkpoint={run}",
            f"--output_dir={out}",
            "--gin.eval_script.evaluate.eval_steps=2",
            *(f"--router={r}" for r in routers),
        ]
    )


@pytest.fixture(scope="module")
def router_results(tiny_run, tmp_path_factory):
    plain_dir, routers_dir = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("routers")
    assert _eval(tiny_run, plain_dir) == 0
    assert (
        _eval(tiny_run, routers_dir, "learned", "init", "random", "hash", "uniform", "shuffled")
        == 0
    )
    return (
        json.loads((plain_dir / "comparison.json").read_text()),
        json.loads((routers_dir / "comparison.json").read_text()),
        routers_dir,
    )


def test_learned_router_equals_plain_evaluation_exactly(router_results, tiny_run):
    plain, routers, _ = router_results
    (label,) = plain
    assert plain[label]["metrics"] == routers[f"{label}:learned"]["metrics"]
    assert plain[label]["routing"] == routers[f"{label}:learned"]["routing"]
    for stats in plain[label]["routing"].values():  # telemetry in the eval report
        assert {"gate_margin", "dead_experts", "shard_imbalance"} <= set(stats)


def test_replaced_routers_change_the_evaluation(router_results):
    _, routers, out = router_results
    ce = {r["router"]: r["metrics"]["cross_entropy"] for r in routers.values()}
    assert set(ce) == {"learned", "init", "random", "hash", "uniform", "shuffled"}
    for name in ("random", "hash", "shuffled"):
        assert ce[name] != ce["learned"], name
    drift = {r["router"]: r["router_drift"] for r in routers.values()}
    assert all(v == 0.0 for v in drift["init"].values())  # the initial router itself
    assert (out / "routers.png").read_bytes()[:4] == b"\x89PNG"
    # one JSON per checkpoint and router, named <label>_<router> (no ':' in file names)
    assert not [p.name for p in out.iterdir() if ":" in p.name]
    for label, result in routers.items():
        checkpoint, _, router = label.partition(":")
        assert (
            json.loads((out / f"{checkpoint}_{router}.json").read_text())["metrics"]
            == result["metrics"]
        )


def test_bad_router_names_and_missing_initial_router(tiny_run, tmp_path, capsys):
    assert _eval(tiny_run, tmp_path, "best") == 1
    assert (
        "valid routers: learned, init, random, hash, uniform, shuffled" in capsys.readouterr().err
    )
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    (copy / "router_init.npz").unlink()
    assert _eval(copy, tmp_path / "out", "init") == 1
    assert "saved no initial router" in capsys.readouterr().err
    assert _eval(copy, tmp_path / "plain") == 0  # the table says why there is no drift
    (result,) = json.loads((tmp_path / "plain" / "comparison.json").read_text()).values()
    assert (
        result["router_drift"] == {}
        and f"{copy}/router_init.npz does not exist" in result["router_drift_missing"]
    )
    assert f"drift of {result['label']} is '-': {copy}/router_init.npz" in capsys.readouterr().out


def test_languages_of_several_runs_go_into_each_run():
    """By default one run's analysis is in its ``MODEL_DIR/analysis``; a comparison of runs
    goes into each run, in a folder named by the runs compared."""
    assert languages.output_dirs(
        ["/r/learned/checkpoints/2", "/r/learned/checkpoints/3"], None
    ) == ["/r/learned/analysis"]
    assert languages.output_dirs(["/r/learned", "/r/frozen/checkpoints/3"], None) == [
        "/r/learned/analysis/learned+frozen",
        "/r/frozen/analysis/learned+frozen",
    ]
    assert languages.output_dirs(["/r/learned", "/r/frozen"], "/elsewhere") == ["/elsewhere"]


@pytest.mark.slow  # 20 per-language data pipelines: about a minute of CPU
def test_analyze_languages_writes_mi_sparsity_and_heatmaps(tiny_run, tmp_path):
    rc = moe_cli.main(
        [
            "analyze",
            "languages",
            f"--checkpoint={tiny_run}",
            "--all_steps",
            f"--out={tmp_path}",
            "--gin.languages_script.analyze.max_examples_per_label=2",
            "--gin.languages_script.analyze.batch_size=8",
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "languages.json").read_text())
    assert report["labels"] == list(sources.embedded_languages())
    (result,) = report["checkpoints"]
    assert result["step"] == 1 and list(result["layers"]) == LAYERS
    assert result["run"] == evaluate.checkpoint_labels([str(tiny_run)])[0] == tiny_run.name
    for stats in result["layers"].values():
        assert 0.0 <= stats["bits"] <= stats["language_entropy_bits"] + 1e-9
        assert 1.0 <= stats["sparsity"] <= 4.0 and 1.0 <= stats["sparsity_shuffled_router"] <= 4.0
        share = np.asarray(stats["top1_share"])
        assert share.shape == (20, 4)
        np.testing.assert_allclose(share.sum(1), 1.0)
    (png,) = report["files"]
    assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_analyze_languages_refuses_unlabelled_data(tiny_run, tmp_path, capsys):
    assert (
        moe_cli.main(
            [
                "analyze",
                "languages",
                f"--checkpoint={tiny_run}",
                f"--out={tmp_path}",
                "--gin.MIXTURE_OR_TASK_NAME='mc4_en_span_corruption'",
            ]
        )
        == 1
    )
    assert "MIXTURE_OR_TASK_NAME='mc4_en_span_corruption'" in capsys.readouterr().err
    assert (
        moe_cli.main(
            [
                "analyze",
                "languages",
                f"--checkpoint={tiny_run}",
                f"--out={tmp_path}",
                "--gin.sources.make_source.corpus='tfds'",
                "--gin.sources.make_source.tfds_name='c4/en:3.1.0'",
            ]
        )
        == 1
    )
    assert "tfds_name='c4/en:3.1.0'" in capsys.readouterr().err
    assert not (tmp_path / "languages.json").exists()


def test_checkpoint_labels_tell_runs_of_the_same_name_apart():
    assert evaluate.checkpoint_labels(
        ["/r/learned/seed0", "/r/frozen/seed0/checkpoints/300", "/r/dense"]
    ) == ["learned/seed0", "frozen/seed0@300", "dense"]
    assert evaluate.checkpoint_labels(["/a/run/500", "/b/run"]) == ["a/run@500", "b/run"]
    assert evaluate.checkpoint_labels(["/x/run/100", "/x/run", "/x/run"]) == [
        "run@100",
        "run",
        "run'",
    ]


def test_labels_of_the_sweep_layout_are_the_shortest_distinct_suffixes():
    """The sweep writes ROOT/<run>/<AXIS>-<value>/seed<N>: the run name must be in the label."""
    paths = ["/root/learned/NUM_EXPERTS-8/seed0", "/root/frozen/NUM_EXPERTS-8/seed0"]
    labels = ["learned/NUM_EXPERTS-8/seed0", "frozen/NUM_EXPERTS-8/seed0"]
    assert evaluate.checkpoint_labels(paths) == labels
    assert run_names.run_labels(paths) == labels
    assert run_names.run_labels(["/tmp/learned", "/tmp/frozen"]) == ["learned", "frozen"]
    assert run_names.file_stem(labels[0] + ":init") == "learned_NUM_EXPERTS-8_seed0_init"


def test_labels_can_be_given_one_per_checkpoint():
    assert evaluate.checkpoint_labels(["/r/a", "/r/b"], ["A", "B"]) == ["A", "B"]
    for given in (["A"], ["A", "A"], ["A", "x:y"]):
        with pytest.raises(errors.UserError):
            evaluate.checkpoint_labels(["/r/a", "/r/b"], given)


def test_routers_plot_is_bars_from_zero_with_error_bars_over_seeds():
    """Routers are categories: bars (no lines joining them), value axes from 0, and the
    seeds of a family pooled into a mean with its standard deviation."""

    def result(label, router, accuracy):
        metrics = {"accuracy": accuracy, "cross_entropy": 5.0 - accuracy}
        return {"label": label, "router": router, "metrics": metrics}

    results = {
        f"{run}/seed{s}:{router}": result(f"{run}/seed{s}", router, 0.3647 + 0.0001 * s + d)
        for run in ("learned", "frozen")
        for s in (0, 1)
        for router, d in (("learned", 0.0), ("random", 0.0007))
    }
    summary = evaluate.router_summary(results, "accuracy")
    mean, std, seeds = summary["learned"]["random"]
    assert seeds == 2 and mean == pytest.approx(0.36545) and std == pytest.approx(0.0001 / 2**0.5)
    fig = evaluate.routers_figure(results)
    for ax in fig.axes:
        assert ax.get_ylim()[0] == 0  # bars from zero
        assert all(line.get_linestyle() == "None" for line in ax.lines)  # error-bar caps only
        assert len(ax.patches) == 4  # 2 families x 2 routers
        assert len(ax.collections) == 2  # the error bars, one set per family
    plotting.pyplot().close(fig)
