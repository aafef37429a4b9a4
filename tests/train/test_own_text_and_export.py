"""A researcher's first day, end to end through the CLI: train on a folder of .txt files
(gin/data/text.gin), evaluate and decode from the run's own config, export to safetensors
and import back (identical parameters and eval outputs), and the refusals on the way."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil

import gin
import numpy as np
import pytest
from safetensors.numpy import load_file

from moe_jax import cli, param_paths
from moe_jax.data import sources, vocab
from moe_jax.interop import export_format
from moe_jax.runtime import checkpoints, router_init
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.run_spec import RunSpec

STEPS = 2
TRAIN = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin_file=data/text.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    f"--gin.TRAIN_STEPS={STEPS}",
    "--gin.train_script.train.eval_period=0",
    "--gin.train_script.train.log_period=1",
]
EVAL = ["--gin.eval_script.evaluate.eval_steps=2"]


@pytest.fixture(autouse=True)
def _fresh_gin():
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> pathlib.Path:
    """A run trained by `moe-jax train` on en/ and de/ folders of real text."""
    root = tmp_path_factory.mktemp("first_day")
    for lang in ("en", "de"):
        (root / "corpus" / lang).mkdir(parents=True)
        shutil.copy(sources.EMBEDDED_DIR / f"{lang}.txt", root / "corpus" / lang / "udhr.txt")
    patterns = {lang: str(root / "corpus" / lang / "*.txt") for lang in ("en", "de")}
    model_dir = root / "run"
    rc = cli.main(
        ["train", *TRAIN, f"--gin.TEXT_TRAIN_FILES={patterns}", f"--gin.MODEL_DIR={model_dir}"]
    )
    gin.clear_config()
    assert rc == 0
    return model_dir


def _eval(capsys, *flags: str) -> tuple[dict, str]:
    assert cli.main(["eval", *EVAL, *flags]) == 0, capsys.readouterr().err
    out_dir = next(f.split("=", 1)[1] for f in flags if "OUTPUT_DIR" in f or "output_dir" in f)
    return json.loads(
        (pathlib.Path(out_dir) / "comparison.json").read_text()
    ), capsys.readouterr().err


def test_training_on_a_folder_of_text_files(text_run):
    spec = RunSpec.from_json((text_run / "run.json").read_text())
    assert spec.data.source["corpus"] == "text" and "de" in spec.data.source["train_patterns"]
    assert spec.data.train.mixture_or_task_name == "text_span_corruption"
    losses = [
        json.loads(line)["loss"]
        for line in (text_run / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(losses) == STEPS and np.all(np.isfinite(losses))
    assert (text_run / "checkpoints" / str(STEPS)).is_dir()


@pytest.mark.slow
def test_infer_reads_the_runs_config_and_t5x_macros(text_run, tmp_path, capsys):
    assert (
        cli.main(
            [
                "infer",
                f"--gin.CHECKPOINT_PATH={text_run}",
                "--input=Everyone has the right to <extra_id_0>.",
                f"--gin.INFER_OUTPUT_DIR={tmp_path / 'i'}",
            ]
        )
        == 0
    )
    assert f"gin config: the run's {text_run}/config.gin" in capsys.readouterr().err
    (line,) = (tmp_path / "i" / "predictions.jsonl").read_text().splitlines()
    assert json.loads(line)["input"] == "Everyone has the right to <extra_id_0>."


def _params(model_dir: pathlib.Path) -> dict[str, np.ndarray]:
    ckpt = checkpoints.Checkpointer(RunDir(model_dir), read_only=True)
    try:
        step = ckpt.latest_step()
        restored = ckpt._manager.restore(step)
    finally:
        ckpt.close()
    return {
        name: np.asarray(leaf)
        for name, leaf in param_paths.named_leaves(restored["params"]).items()
    }


def test_export_then_import_gives_identical_parameters_and_eval(text_run, tmp_path, capsys):
    out, back = tmp_path / "export", tmp_path / "imported"
    assert cli.main(["export", f"--checkpoint={text_run}", f"--out={out}"]) == 0
    arrays = load_file(out / export_format.WEIGHTS_FILE)
    config = json.loads((out / export_format.CONFIG_JSON).read_text())
    # T5X/Flaxformer names and layouts (size_tiny: d_model 32, 4 heads x 8, 4 experts, d_ff 64)
    assert arrays["encoder/layers_0/attention/query/kernel"].shape == (32, 32)
    assert arrays["decoder/layers_1/encoder_decoder_attention/out/kernel"].shape == (32, 32)
    assert arrays["encoder/layers_1/mlp/expert/wi_0/kernel"].shape == (4, 32, 64)
    assert arrays["encoder/layers_1/mlp/router/router_weights/w/kernel"].shape == (32, 4)
    assert arrays["decoder/decoder_norm/scale"].shape == (32,)
    assert set(arrays) == set(config["arrays"]) and config["step"] == STEPS
    assert config["t5_config"]["moe"]["num_experts"] == 4 and config["t5_config"]["emb_dim"] == 32
    assert config["version"] == export_format.FORMAT_VERSION == 2 and config["routing"] == {
        "router_mode": "learned"
    }
    # the initial routers, under the routers' exported names, beside the model
    initial = load_file(out / export_format.ROUTER_INIT_FILE)
    assert (
        sorted(initial)
        == config["router_init"]["arrays"]
        == sorted(n for n in arrays if "/router/" in n)
    )
    assert not np.array_equal(
        initial["encoder/layers_1/mlp/router/router_weights/w/kernel"],
        arrays["encoder/layers_1/mlp/router/router_weights/w/kernel"],
    )  # trained

    # self-contained: the vocabulary travels with the export, config.json names no local path
    assert (out / export_format.VOCAB_FILE).read_bytes() == vocab.EMBEDDED_SPM.read_bytes()
    assert (
        config["vocabulary"]["file"] == export_format.VOCAB_FILE
        and "path" not in config["vocabulary"]
    )
    # the run's spec travels with it, and the import restores it (its vocabulary the copy)
    assert config["run_spec"] == export_format.RUN_SPEC_FILE
    assert (out / export_format.RUN_SPEC_FILE).read_text() == (text_run / "run.json").read_text()
    moved = tmp_path / "moved_export"
    out.rename(moved)
    assert cli.main(["import", f"--export={moved}", f"--model_dir={back}"]) == 0
    spec = RunSpec.from_json((text_run / "run.json").read_text())
    copy = str(back / export_format.VOCAB_FILE)
    vocabulary = dataclasses.replace(spec.model.vocabulary, path=copy)
    assert RunSpec.from_json((back / "run.json").read_text()) == dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, vocabulary=vocabulary)
    )
    assert (back / export_format.VOCAB_FILE).read_bytes() == (
        moved / export_format.VOCAB_FILE
    ).read_bytes()
    assert f"vocab.get_vocabulary.path = {str(back / export_format.VOCAB_FILE)!r}" in (
        (back / "config.gin").read_text().splitlines()
    )
    original, imported = _params(text_run), _params(back)
    assert original.keys() == imported.keys()
    for name in original:
        np.testing.assert_array_equal(imported[name], original[name], err_msg=name)
    original_init, imported_init = (
        router_init.load(RunDir(text_run)),
        router_init.load(RunDir(back)),
    )
    assert original_init and original_init.keys() == imported_init.keys()
    for name in original_init:
        np.testing.assert_array_equal(imported_init[name], original_init[name], err_msg=name)
    # eval with no gin file reads each run's config.gin; T5X's macros or the flags
    first, err = _eval(
        capsys, f"--gin.CHECKPOINT_PATH={text_run}", f"--gin.EVAL_OUTPUT_DIR={tmp_path / 'e1'}"
    )
    assert f"gin config: the run's {text_run}/config.gin" in err
    second, err = _eval(capsys, f"--checkpoint={back}", f"--output_dir={tmp_path / 'e2'}")
    assert f"gin config: the run's {back}/config.gin" in err
    (a,), (b,) = first.values(), second.values()
    assert a["step"] == b["step"] == STEPS and np.isfinite(a["metrics"]["loss"])
    assert a["metrics"] == b["metrics"] and a["routing"] == b["routing"]
    assert (
        a["router_drift"] == b["router_drift"] and len(b["router_drift"]) == len(b["routing"]) > 0
    )
    assert all(v > 0 for v in b["router_drift"].values())


def test_import_into_another_shape_names_the_array_and_both_shapes(text_run, tmp_path, capsys):
    out = tmp_path / "export"
    assert cli.main(["export", f"--checkpoint={text_run}", f"--out={out}"]) == 0
    capsys.readouterr()
    assert (
        cli.main(
            ["import", f"--export={out}", f"--model_dir={tmp_path / 'x'}", "--gin.NUM_EXPERTS=8"]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert re.search(
        r"array '(en|de)coder/layers_1/mlp/\S+' has shape \[[^]]*\] in the export "
        r"but \[[^]]*8[^]]*\] in the gin config's model",
        err,
    ), err
    assert not (tmp_path / "x").exists()  # refused before anything is written
    # an export whose run.json is no run's spec: refused naming it, nothing written
    (out / export_format.RUN_SPEC_FILE).write_text("[1, 2]")
    assert cli.main(["import", f"--export={out}", f"--model_dir={tmp_path / 'y'}"]) == 1
    assert f"{out / export_format.RUN_SPEC_FILE} is unreadable" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_export_of_an_unreadable_checkpoint_says_so(text_run, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(text_run, broken)
    for f in (broken / "checkpoints" / str(STEPS) / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and not f.name.startswith("_"):
            f.write_bytes(b"\0not a tensorstore chunk")
    assert cli.main(["export", f"--checkpoint={broken}", f"--out={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert f"cannot read the checkpoint at '{broken}'" in err
    assert not (tmp_path / "out" / export_format.WEIGHTS_FILE).exists()
