"""Refusals of `moe-jax import --hf` and `export --format=hf`: one line naming the tensor,
option or architecture, and nothing written."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from moe_jax import cli
from moe_jax.interop import hf
from moe_jax.models.t5 import T5Config
from tests.interop.conftest import FIXTURES


def _copy(tmp_path: pathlib.Path, case: str = "switch_step2") -> pathlib.Path:
    folder = tmp_path / case
    shutil.copytree(FIXTURES / case, folder)
    return folder


def _import_fails(folder: pathlib.Path, tmp_path: pathlib.Path, capsys) -> str:
    run = tmp_path / "run"
    assert cli.main(["import", f"--hf={folder}", f"--model_dir={run}"]) == 1
    assert not run.exists()  # nothing written
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    return line


def test_a_missing_tensor_is_named(tmp_path, capsys):
    folder = _copy(tmp_path)
    arrays = load_file(folder / "model.safetensors")
    del arrays["encoder.block.3.layer.1.mlp.experts.expert_2.wo.weight"]
    save_file(arrays, folder / "model.safetensors")
    line = _import_fails(folder, tmp_path, capsys)
    assert "tensor 'encoder.block.3.layer.1.mlp.experts.expert_2.wo.weight' is missing" in line


def test_a_shape_that_disagrees_with_config_json_is_named(tmp_path, capsys):
    folder = _copy(tmp_path, "t5_v1_1")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "d_ff": 32}))
    line = _import_fails(folder, tmp_path, capsys)
    assert "tensor 'encoder.block.0.layer.1.DenseReluDense.wi_0.weight' has shape [24, 16]" in line
    assert "config.json gives [32, 16]" in line


def test_an_unsupported_architecture_or_activation_is_named(tmp_path, capsys):
    folder = _copy(tmp_path, "t5_v1_1")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["BartModel"]}))
    assert "architectures=['BartModel'] is not supported" in _import_fails(folder, tmp_path, capsys)
    (folder / "config.json").write_text(json.dumps({**config, "feed_forward_proj": "gated-silu"}))
    assert "feed_forward_proj='gated-silu' is not supported" in _import_fails(
        folder, tmp_path, capsys
    )


def test_switch_rule_is_transformers_placement():
    assert hf.switch_rule(12, 6) == (1, 3, 5, 7, 9, 11)
    assert hf.switch_rule(12, 3) == (1, 5, 9)
    assert hf.switch_rule(2, 2) == (0, 1)
    assert hf.switch_rule(3, 1) == (1,)


def _switch(**moe) -> T5Config:
    folder = hf.read_folder(str(FIXTURES / "switch_step2"))
    data = hf.t5_config(folder).to_dict()
    data["moe"] = {**data["moe"], **moe}
    return T5Config.from_dict(data)


def test_a_model_switch_transformers_cannot_hold_is_refused_naming_the_option():
    # top-2 with moe-jax's own losses (transformers' router losses are top-1's)
    top2 = _switch(router={"type": "top_k", "num_selected_experts": 2}, losses={})
    with pytest.raises(hf.HfError, match="num_selected_experts=2"):
        hf.config_json(top2)
    with pytest.raises(hf.HfError, match=r"MoeConfig\.activation='gated_gelu'"):
        hf.config_json(_switch(activation="gated_gelu"))
    placed = T5Config.from_dict({**_switch().to_dict(), "sparse_encoder_layers": [0, 2]})
    with pytest.raises(hf.HfError, match=r"encoder's sparse layers \[0, 2\] are not where"):
        hf.config_json(placed)


def test_a_sharded_folder_reads_as_the_single_file(tmp_path):
    folder = _copy(tmp_path, "t5_v1_1")
    arrays = load_file(folder / "model.safetensors")
    names = sorted(arrays)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, part in shards.items():
        save_file({n: arrays[n] for n in part}, folder / shard)
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "model.safetensors").unlink()
    read = hf.read_folder(str(folder))
    assert sorted(read.arrays) == names
    assert all((read.arrays[n] == arrays[n]).all() for n in names)


def test_mt5_with_its_sentencepiece_model_becomes_the_runs_vocabulary(tmp_path):
    from moe_jax.data import vocab

    folder = _copy(tmp_path, "t5_v1_1")
    config = json.loads((folder / "config.json").read_text())
    mt5 = {**config, "architectures": ["MT5ForConditionalGeneration"], "vocab_size": 8192}
    (folder / "config.json").write_text(json.dumps(mt5))
    arrays = load_file(folder / "model.safetensors")
    arrays["shared.weight"] = np.resize(arrays["shared.weight"], (8192, 16))
    save_file(arrays, folder / "model.safetensors")
    shutil.copy(vocab.EMBEDDED_SPM, folder / "spiece.model")
    run = tmp_path / "run"
    assert cli.main(["import", f"--hf={folder}", f"--model_dir={run}"]) == 0
    assert (run / "vocabulary.model").read_bytes() == vocab.EMBEDDED_SPM.read_bytes()
    text = (run / "config.gin").read_text()
    assert "vocab.get_vocabulary.kind = 'sentencepiece'" in text
    assert "vocab.get_vocabulary.extra_ids = 0" in text  # mT5's model holds its sentinels
    assert f"vocab.get_vocabulary.path = {str(run / 'vocabulary.model')!r}" in text


def test_tensors_the_config_does_not_describe_are_named(tmp_path, capsys):
    folder = _copy(tmp_path, "switch_step2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "router_bias": False}))
    line = _import_fails(folder, tmp_path, capsys)
    assert "tensors ['decoder.block.1.layer.2.mlp.router.classifier.bias'" in line


def test_a_tied_head_saved_beside_the_embedding_stays_tied_and_scaled(tmp_path):
    folder = _copy(tmp_path, "t5_relu_tied")
    arrays = load_file(folder / "model.safetensors")
    save_file({**arrays, "lm_head.weight": arrays["shared.weight"]}, folder / "model.safetensors")
    assert hf.t5_config(hf.read_folder(str(folder))).logits_via_embedding
    arrays["lm_head.weight"] = arrays["shared.weight"] + 1.0  # a head of its own: untied
    save_file(arrays, folder / "model.safetensors")
    assert not hf.t5_config(hf.read_folder(str(folder))).logits_via_embedding
