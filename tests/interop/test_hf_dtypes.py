"""The dtypes of a Hugging Face folder's safetensors: bfloat16 (most released mT5 and
Switch folders), which ``safetensors.numpy`` cannot read, imports as its float32 values;
a dtype moe-jax does not read, or a file that is not safetensors, is named."""

from __future__ import annotations

import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from moe_jax import cli
from moe_jax.interop import hf
from tests.interop.conftest import FIXTURES


def _copy(tmp_path: pathlib.Path, case: str) -> pathlib.Path:
    folder = tmp_path / case
    shutil.copytree(FIXTURES / case, folder)
    return folder


def test_a_bfloat16_folder_imports_as_its_float32_values(tmp_path):
    folder = _copy(tmp_path, "switch_step2")
    original = load_file(folder / "model.safetensors")
    save_file(
        {k: v.astype(ml_dtypes.bfloat16) for k, v in original.items()},
        folder / "model.safetensors",
    )
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    read = hf.read_folder(str(folder))
    assert {a.dtype for a in read.arrays.values()} == {np.dtype(ml_dtypes.bfloat16)}
    run, out = tmp_path / "run", tmp_path / "hf"
    assert cli.main(["import", f"--hf={folder}", f"--model_dir={run}"]) == 0
    assert cli.main(["export", "--format=hf", f"--checkpoint={run}", f"--out={out}"]) == 0
    exported = load_file(out / "model.safetensors")
    for name, array in original.items():  # float32, the bfloat16 values exactly
        expected = array.astype(ml_dtypes.bfloat16).astype(np.float32)
        assert exported[name].dtype == np.float32, name
        np.testing.assert_array_equal(exported[name], expected, err_msg=name)


def _import_line(folder: pathlib.Path, tmp_path: pathlib.Path, capsys) -> str:
    run = tmp_path / "run"
    assert cli.main(["import", f"--hf={folder}", f"--model_dir={run}"]) == 1
    assert not run.exists()
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_an_unread_dtype_or_a_file_that_is_not_safetensors_is_named(tmp_path, capsys):
    folder = _copy(tmp_path, "t5_v1_1")
    weights = folder / "model.safetensors"
    arrays = load_file(weights)
    save_file({**arrays, "shared.weight": arrays["shared.weight"].astype(np.complex64)}, weights)
    line = _import_line(folder, tmp_path, capsys)
    assert f"cannot read {weights}: tensor 'shared.weight' has dtype C64" in line
    assert "moe-jax reads F64, F32, F16, BF16" in line
    weights.write_bytes(b"not safetensors")
    assert f"cannot read {weights}: " in _import_line(folder, tmp_path, capsys)
