"""Per-token routing traces: planted routings survive the Parquet round trip,
`moe-jax analyze trace` writes one row per real token and MoE layer of a tiny checkpoint,
and the analyses of traces read with ``--trace`` report what they report routing again."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from moe_jax import errors
from moe_jax.analysis import trace
from moe_jax.commands import analyze
from moe_jax.data import vocab
from moe_jax.runtime import routing

LAYERS = ["encoder/layers_1", "decoder/layers_1"]


def planted_routing() -> routing.LayerRouting:
    """2 rows of 4 slots, the last slot of row 1 padding; 3 experts, top-2."""
    probs = np.array(
        [
            [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.3, 0.5], [0.5, 0.4, 0.1]],
            [[0.1, 0.1, 0.8], [0.6, 0.1, 0.3], [0.3, 0.6, 0.1], [1 / 3, 1 / 3, 1 / 3]],
        ],
        np.float32,
    )
    index = np.argsort(-probs, axis=-1)[..., :2].astype(np.int32)
    segments = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.int32)
    index[1, 3] = 3  # padding: no expert
    kept = np.ones((2, 4, 2), bool)
    kept[0, 2, 0] = False  # one dropped first choice
    kept[1, 1] = False  # a token with no choice kept
    kept[1, 3] = False
    return routing.LayerRouting(
        expert_index=index,
        router_probs=probs,
        router_inputs=np.zeros((2, 4, 5), np.float32),
        positions=np.broadcast_to(np.arange(4, dtype=np.int32), (2, 4)).copy(),
        segments=segments,
        kept=kept,
    )


def test_layer_trace_keeps_real_tokens_with_their_choices_and_probabilities():
    layer = trace.layer_trace(
        planted_routing(), np.array([[5, 6, 7, 8], [9, 10, 11, 0]]), np.array([1, 0])
    )
    assert len(layer.token_id) == 7 and layer.k == 2 and layer.num_experts == 3
    np.testing.assert_array_equal(layer.example, [0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(layer.position, [0, 1, 2, 3, 0, 1, 2])
    np.testing.assert_array_equal(layer.token_id, [5, 6, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(layer.label, [1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(layer.experts[:3], [[0, 1], [1, 2], [2, 1]])
    np.testing.assert_allclose(layer.probs[:3], [[0.7, 0.2], [0.6, 0.3], [0.5, 0.3]])
    np.testing.assert_array_equal(layer.dropped, [0, 0, 0, 0, 0, 1, 0])


def test_parquet_round_trip_keeps_every_array(tmp_path):
    layer = trace.layer_trace(planted_routing(), np.array([[5, 6, 7, 8], [9, 10, 11, 0]]), None)
    original = trace.Trace(
        "learned/seed0",
        300,
        {"encoder/layers_1": layer},
        (),
        {i: f"p{i}" for i in range(5, 12)},
        data={"split": "train", "task_feature_lengths": {"inputs": 4, "targets": 4}},
    )
    path = trace.write(original, str(tmp_path))
    assert path.endswith("trace_learned_seed0_step300.parquet")
    back = trace.read(path)
    assert (back.run, back.step, back.labels) == ("learned/seed0", 300, ())
    assert back.data == original.data
    got = back.layers["encoder/layers_1"]
    for name in ("example", "position", "token_id", "label", "experts", "probs", "kept"):
        np.testing.assert_array_equal(getattr(got, name), getattr(layer, name), err_msg=name)
    assert got.num_experts == 3 and back.pieces[7] == "p7"
    table = pq.read_table(path)
    assert table.column_names == trace._schema().names
    assert table["label"].null_count == 7 and table["dropped"].to_pylist().count(True) == 1


def test_traces_of_different_data_are_refused_naming_the_setting():
    layer = trace.layer_trace(planted_routing(), np.zeros((2, 4), np.int32), None)

    def made(step: int, **data) -> trace.Trace:
        return trace.Trace("a", step, {"encoder/layers_1": layer}, data=data)

    paths = ["t/trace_a_step1.parquet", "t/trace_a_step2.parquet", "t/trace_a_step3.parquet"]
    same = [
        made(1, split="train", max_examples=40),
        made(2),
        made(3, split="train", max_examples=40),
    ]
    trace.check_same_data(same, paths)  # a file without settings is not compared
    other = [*same[:2], made(3, split="train", max_examples=80)]
    with pytest.raises(
        errors.InputFileError,
        match=r"trace_a_step1.parquet and trace_a_step3.parquet route "
        r"different data \(max_examples: 40 vs 80\)",
    ):
        trace.check_same_data(other, paths)


def test_a_table_of_two_checkpoints_is_refused(tmp_path):
    import pyarrow as pa

    layer = trace.layer_trace(planted_routing(), np.zeros((2, 4), np.int32), None)
    tables = [
        trace.to_table(trace.Trace("a", step, {"encoder/layers_1": layer})) for step in (1, 2)
    ]
    with pytest.raises(ValueError, match="one checkpoint"):
        trace.from_table(pa.concat_tables(tables))


def _run(analysis: str, tiny_run, out, *extra: str, labels: bool = False) -> None:
    """``analysis`` on 40 examples: of the run's task itself (one data pipeline), or with
    ``labels`` 2 of each of the 20 languages' tasks (20 pipelines)."""
    flags = [
        "--gin.trace_script.collect.max_examples=40",
        "--gin.trace_script.collect.batch_size=8",
        f"--gin.trace_script.collect.use_labels={labels}",
    ]
    assert analyze.main([analysis, *extra, f"--out={out}", *flags]) == 0


def _same_from_trace(analysis: str, tiny_run, traced, out, *checkpoints: str) -> None:
    """``analysis`` of ``checkpoints`` read from the trace folder ``traced`` reports what the
    routed run already in ``out`` reported."""
    import json

    _run(analysis, tiny_run, out / "read", *checkpoints, f"--trace={traced}")
    read = json.loads((out / "read" / f"{analysis}.json").read_text())
    assert read == json.loads((out / f"{analysis}.json").read_text())


@pytest.fixture(scope="module")
def traced(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("trace")
    _run("trace", tiny_run, out, f"--checkpoint={tiny_run}", "--all_steps")
    return out


def test_cli_writes_a_row_per_token_and_layer(traced):
    files = sorted(traced.glob("trace_*.parquet"))
    assert [f.name for f in files] == ["trace_tiny_run0_step1.parquet"]
    table = pq.read_table(files[0])
    back = trace.from_table(table)
    assert list(back.layers) == LAYERS and back.step == 1
    assert back.labels == () and table["label"].null_count == table.num_rows  # use_labels off
    assert back.data["max_examples"] == back.data["examples"] == 40
    assert back.data["use_labels"] is False and back.data["split"] == "train"
    assert back.data["task_feature_lengths"] == {"inputs": 32, "targets": 8}
    enc, dec = (back.layers[name] for name in LAYERS)
    assert enc.example.max() == dec.example.max() == 39
    assert enc.position.max() < 32 and dec.position.max() < 8 and dec.position.min() == 0
    for layer in (enc, dec):
        assert layer.k == 2 and layer.num_experts == 4
        assert (np.diff(layer.probs, axis=1) <= 0).all()  # best first
        assert (layer.experts[:, 0] != layer.experts[:, 1]).all()
        assert (layer.experts < 4).all() and (layer.probs > 0).all()
    # decoder layers route the decoder's input: id 0 starts every example
    assert (dec.token_id[dec.position == 0] == 0).all()
    spm = vocab.selected_vocabulary().tokenizer
    pieces = table["piece"].to_pylist()
    ids = table["token_id"].to_pylist()
    assert all(
        piece == spm.id_to_piece(i) for piece, i in zip(pieces, ids, strict=True) if i < 8000
    )


def test_vocabulary_and_coactivation_commands(tiny_run, traced, tmp_path):
    import json

    _run("vocabulary", tiny_run, tmp_path, f"--checkpoint={tiny_run}")
    report = json.loads((tmp_path / "vocabulary.json").read_text())
    (result,) = report["checkpoints"]
    assert list(result["layers"]) == LAYERS and report["files"] == [
        "vocabulary_tiny_run0_step1.png"
    ]
    for stats in result["layers"].values():
        assert sum(stats["category_tokens"]) == stats["num_tokens"]
        assert 0 < stats["random_router"] <= stats["token_consistency"] <= 1
    # decoder position 0 is the start token, a special one
    assert result["layers"]["decoder/layers_1"]["category_tokens"][0] >= 40
    _same_from_trace("vocabulary", tiny_run, traced, tmp_path, f"--checkpoint={tiny_run}")
    _run("coactivation", tiny_run, tmp_path, f"--checkpoint={tiny_run}")
    report = json.loads((tmp_path / "coactivation.json").read_text())
    (result,) = report["checkpoints"]
    for stats in result["layers"].values():
        matrix = np.asarray(stats["coactivation"])
        assert matrix.shape == (4, 4) and (np.diag(matrix) == 0).all()
        # top-2: every token choosing i chose exactly one other expert
        np.testing.assert_allclose(matrix.sum(1)[matrix.sum(1) > 0], 1.0)
    assert result["cross_layer"]["predictability"][0] == [1.0, None]
    for name in report["files"]:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    _same_from_trace("coactivation", tiny_run, traced, tmp_path, f"--checkpoint={tiny_run}")


def test_saturation_command_and_its_refusal(tiny_run, traced, tmp_path):
    import json

    step = f"--checkpoint={tiny_run}/checkpoints/1"
    _run("saturation", tiny_run, tmp_path, step, step)
    report = json.loads((tmp_path / "saturation.json").read_text())
    (run,) = report["runs"]
    assert run["steps"] == [1, 1] and report["files"] == ["saturation.png"]
    for curves in run["layers"].values():  # a checkpoint agrees with itself
        assert curves["top1"] == [1.0, 1.0] and curves["topk"] == [1.0, 1.0]
        assert curves["top1_random"][0] < 1.0
    _same_from_trace("saturation", tiny_run, traced, tmp_path, step, step)
    with pytest.raises(ValueError, match="has one: pass --all_steps"):
        _run("saturation", tiny_run, tmp_path, step)


def test_trace_labels_each_example_with_its_language(tiny_run, tmp_path):
    _run("trace", tiny_run, tmp_path, f"--checkpoint={tiny_run}", labels=True)
    (path,) = tmp_path.glob("trace_*.parquet")
    back = trace.read(str(path))
    assert len(back.labels) == 20 and "de" in back.labels
    for layer in back.layers.values():  # 2 examples per language, one after the other
        first = np.searchsorted(layer.example, np.arange(40))  # each example's first token
        names = np.asarray(back.labels)[layer.label[first]]
        assert len(set(names)) == 20 and (names[0::2] == names[1::2]).all()
        assert (layer.label == layer.label[first][layer.example]).all()  # one per example


def test_a_trace_folder_without_a_compared_step_is_one_error_line(tiny_run, traced, capsys):
    from moe_jax import cli

    steps = [f"--checkpoint={tiny_run}/checkpoints/{step}" for step in (1, 2)]
    argv = ["saturation", *steps, f"--trace={traced}", f"--out={traced}/saturation"]
    assert cli.run_command("analyze", analyze.main, argv) == 1
    *_, line = capsys.readouterr().err.strip().splitlines()  # after the gin config line
    assert line.startswith(f"moe-jax analyze: error: --trace={traced} holds no trace of ")
    assert "tiny_run0@2 (it holds trace_tiny_run0_step1.parquet)" in line
    empty = traced / "empty"
    argv = ["vocabulary", f"--checkpoint={tiny_run}", f"--trace={empty}", f"--out={empty}"]
    assert cli.run_command("analyze", analyze.main, argv) == 1
    assert "holds no trace of tiny_run0@1 (it holds none)" in capsys.readouterr().err
