"""A run's files are data, not instructions: a run directory's or export's config runs no
code the command line does not name, and exports and imports never write over another run."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil

import gin
import numpy as np
import pytest

from moe_jax import cli, errors
from moe_jax.runtime import (
    builders,
    config_gate,
    gin_flags,
    gin_text,
    output_lock,
    run_config,
    run_lock,
)
from moe_jax.runtime.run_dir import RunDir

STEPS = 2
TRAIN = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    f"--gin.TRAIN_STEPS={STEPS}",
    "--gin.train_script.train.eval_period=0",
    "--gin.train_script.train.log_period=1",
]


@pytest.fixture(autouse=True)
def _fresh_gin():
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """A run trained by `moe-jax train` (checkpoints 1 and 2) and its export."""
    root = tmp_path_factory.mktemp("boundaries")
    model_dir, out = root / "run", root / "export"
    assert cli.main(["train", *TRAIN, f"--gin.MODEL_DIR={model_dir}"]) == 0
    assert cli.main(["export", f"--checkpoint={model_dir}", f"--out={out}"]) == 0
    gin.clear_config()
    return model_dir, out


@pytest.fixture(scope="module")
def poisoned(run_and_export, tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """Copies of the run and the export whose config.gin names a payload ``.py`` file as
    ``MIXTURE_OR_TASK_MODULE``; the payload writes ``payload.ran`` beside itself when run."""
    root = tmp_path_factory.mktemp("poisoned")
    payload = root / "payload.py"
    payload.write_text(
        "import pathlib\npathlib.Path(__file__).with_suffix('.ran').write_text('ran')\n"
    )
    copies = []
    for source in run_and_export:
        copy = root / source.name
        shutil.copytree(source, copy)
        config = copy / "config.gin"
        text = config.read_text()
        assert "MIXTURE_OR_TASK_MODULE = None\n" in text
        config.write_text(
            text.replace(
                "MIXTURE_OR_TASK_MODULE = None\n", f"MIXTURE_OR_TASK_MODULE = {str(payload)!r}\n"
            )
        )
        copies.append(copy)
    return copies[0], copies[1], payload


def _refusal(config: pathlib.Path, payload: pathlib.Path) -> str:
    line = next(
        i
        for i, text in enumerate(config.read_text().splitlines(), 1)
        if text.startswith("MIXTURE_OR_TASK_MODULE")
    )
    return (
        f"{config}, line {line}: refusing MIXTURE_OR_TASK_MODULE = {str(payload)!r}: a run's "
        "config may name only the project's modules or those given on the command line "
        f"(importing it would run its code); to trust it, pass "
        f"--gin.MIXTURE_OR_TASK_MODULE={payload}"
    )


def _last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def _commands(
    run: pathlib.Path, export_dir: pathlib.Path, out: pathlib.Path
) -> dict[str, list[str]]:
    """Each command that reads a run's (or an export's) config, and where it reads it."""
    return {
        "eval": ["eval", f"--checkpoint={run}", "--gin.EVAL_STEPS=1", f"--output_dir={out}"],
        "infer": ["infer", f"--checkpoint={run}", "--input=hello"],
        "analyze positions": ["analyze", "positions", f"--checkpoint={run}", f"--out={out}"],
        "analyze languages": ["analyze", "languages", f"--checkpoint={run}", f"--out={out}"],
        "export": ["export", f"--checkpoint={run}", f"--out={out}"],
        "import": ["import", f"--export={export_dir}", f"--model_dir={out}"],
        # a run's config named on the command line (T5X's way to continue or upcycle a run)
        "train": ["train", f"--gin_file={run / 'config.gin'}", "--gin.TRAIN_STEPS=3"],
        "upcycle": [
            "upcycle",
            f"--checkpoint={run}",
            f"--out={out}",
            f"--gin_file={run / 'config.gin'}",
        ],
    }


@pytest.mark.parametrize(
    "command",
    [
        "eval",
        "infer",
        "analyze positions",
        "analyze languages",
        "export",
        "import",
        "train",
        "upcycle",
    ],
)
def test_a_run_config_naming_a_module_is_refused_by_every_command(
    poisoned, tmp_path, capsys, command
):
    run, export_dir, payload = poisoned
    argv = _commands(run, export_dir, tmp_path / "out")[command]
    assert cli.main(argv) == errors.EXIT_USER_ERROR
    config = (export_dir if command == "import" else run) / "config.gin"
    name = "analyze" if command.startswith("analyze") else command
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"moe-jax {name}: error: {_refusal(config, payload)}"
    )
    assert not payload.with_suffix(".ran").exists()  # the payload never ran
    assert not (tmp_path / "out").exists()  # and nothing was written


def test_the_same_module_on_the_command_line_is_trusted(poisoned, tmp_path, capsys):
    run, export_dir, payload = poisoned
    trust = f"--gin.MIXTURE_OR_TASK_MODULE={payload}"
    args = gin_flags.parse_flags(builders.build_parser("t", "t"), [trust])
    for source in (run, export_dir):  # the one gate every command's reading goes through
        assert run_config.run_config_file(RunDir(source), args) == str(source / "config.gin")
    assert not payload.with_suffix(".ran").exists()
    argv = _commands(run, export_dir, tmp_path / "out")["eval"]
    assert cli.main([*argv, "--eval_settings=gin", trust]) == 0, capsys.readouterr().err
    assert payload.with_suffix(".ran").read_text() == "ran"  # the user asked for it
    payload.with_suffix(".ran").unlink()


def test_recorded_eval_settings_naming_a_module_are_refused(run_and_export, tmp_path, capsys):
    run, _ = run_and_export
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    settings = pathlib.Path(RunDir(copy).eval_settings_file)
    settings.write_text(settings.read_text().replace('"module": null', '"module": "eviltasks"'))
    assert cli.main(["eval", f"--checkpoint={copy}", "--eval_steps=1"]) == 1
    line = _last_line(capsys)
    assert line.startswith(f"moe-jax eval: error: {settings}: refusing ")
    assert "eval/utils.DatasetConfig.module = 'eviltasks'" in line


def test_import_bindings_are_found_however_written():
    text = """X = 'a.b'
MIXTURE_OR_TASK_MODULE/macro.value = 'm1'
eval/utils.DatasetConfig.module = %X
train/DatasetConfig.module = %MIXTURE_OR_TASK_MODULE
DatasetConfig:
  module = 'm2'
MODEL/EncoderDecoderModel.module = @EncoderDecoder()
train_eval/DatasetConfig.module = %TFDS_DATA_DIR
"""
    assert config_gate.import_bindings(text, "t") == [
        ("MIXTURE_OR_TASK_MODULE", 2, "m1"),
        ("eval/utils.DatasetConfig.module", 3, "a.b"),
        ("train/DatasetConfig.module", 4, "m1"),
        ("DatasetConfig.module", 6, "m2"),
        ("train_eval/DatasetConfig.module", 8, "%TFDS_DATA_DIR"),
    ]
    # a macro the text does not set is checked where it is set (defaults, command line)
    assert config_gate.import_bindings("DatasetConfig.module = %MIXTURE_OR_TASK_MODULE", "t") == []
    trusted = argparse.Namespace(
        command_line_bindings=["MIXTURE_OR_TASK_MODULE = 'a.b'"],
        command_line_gin_files=[],
        gin_search_paths=[],
    )
    config_gate.refuse_untrusted_modules(
        "t", [("M", 1, "a.b"), ("M", 2, "moe_jax.data.tasks")], trusted
    )
    with pytest.raises(config_gate.UntrustedCodeError, match=r"^t, line 3: refusing M = 'm1'"):
        config_gate.refuse_untrusted_modules("t", [("M", 3, "m1")], trusted)


def test_export_writes_only_into_a_new_empty_or_overwritten_directory(
    run_and_export, tmp_path, capsys
):
    run, _ = run_and_export
    other = tmp_path / "other_run"  # another run: its files must stay as they are
    shutil.copytree(run, other)
    config = (other / "config.gin").read_text()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    export = ["export", f"--checkpoint={run}"]
    assert cli.main([*export, f"--out={mine}"]) == 1
    assert _last_line(capsys) == (
        f"moe-jax export: error: --out={mine} is not empty (notes.txt); "
        "pass --overwrite to write into it"
    )
    for target in (other, run):  # another run, or the run itself: never, even with --overwrite
        assert cli.main([*export, f"--out={target}", "--overwrite"]) == 1
        assert _last_line(capsys).startswith(
            f"moe-jax export: error: --out={target} holds another run (checkpoints, config.gin, "
        )
        assert not (target / "model.safetensors").exists()
    assert (other / "config.gin").read_text() == config
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert cli.main([*export, f"--out={mine}", "--overwrite"]) == 0
    assert (mine / "model.safetensors").exists() and (mine / "notes.txt").read_text() == "mine"
    modes = {p.name: p.stat().st_mode & 0o777 for p in mine.iterdir()}
    assert len(set(modes.values())) == 1, modes  # safetensors as readable as the rest


def test_import_never_writes_into_another_run(run_and_export, tmp_path, capsys):
    run, export_dir = run_and_export
    other = tmp_path / "other_run"
    shutil.copytree(run, other)
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    assert (
        cli.main(["import", f"--export={export_dir}", f"--model_dir={other}", "--overwrite"]) == 1
    )
    assert _last_line(capsys).startswith(
        f"moe-jax import: error: --model_dir={other} holds another run (checkpoints, "
    )
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
    # the run the export came from, missing that step: --overwrite puts it back, config kept
    source = json.loads((export_dir / "config.json").read_text())["source_checkpoint"]
    assert source == str(run)
    own_export = tmp_path / "own_export"
    shutil.copytree(export_dir, own_export)
    (own_export / "config.json").write_text(
        (own_export / "config.json")
        .read_text()
        .replace(json.dumps(str(run)), json.dumps(str(other)))
    )
    shutil.rmtree(other / "checkpoints" / str(STEPS))
    imported = ["import", f"--export={own_export}", f"--model_dir={other}"]
    assert cli.main(imported) == 1
    assert _last_line(capsys).startswith(f"moe-jax import: error: --model_dir={other} is not empty")
    assert cli.main([*imported, "--overwrite"]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(other / "checkpoints")) == [str(STEPS)]
    assert (other / "config.gin").read_bytes() == before[other / "config.gin"]


def test_commands_read_the_config_a_checkpoint_was_trained_with(tmp_path):
    """After an accepted change at step 3 (config.step-3.gin), checkpoints from step 3 on
    are read with it, earlier ones with config.gin."""
    for step in (1, 3, 5):
        (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
    (tmp_path / "config.gin").write_text("A = 1\n")
    (tmp_path / "config.step-3.gin").write_text("# resumed at step 3\nA = 2\n")
    args = gin_flags.parse_flags(builders.build_parser("t", "t"), [])
    read = {
        checkpoint: run_config.checkpoint_config(str(tmp_path / checkpoint), args)
        for checkpoint in ("checkpoints/1", "checkpoints/3", "5", "")
    }
    assert read == {
        "checkpoints/1": str(tmp_path / "config.gin"),
        "checkpoints/3": str(tmp_path / "config.step-3.gin"),
        "5": str(tmp_path / "config.step-3.gin"),
        "": str(tmp_path / "config.step-3.gin"),
    }


def test_a_module_on_the_path_is_refused_as_well(run_and_export, tmp_path, monkeypatch, capsys):
    run, _ = run_and_export
    (tmp_path / "pkg").mkdir()
    marker = tmp_path / "ran"
    (tmp_path / "pkg" / "eviltasks.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    config = copy / "config.gin"
    config.write_text(
        config.read_text().replace(
            "MIXTURE_OR_TASK_MODULE = None\n", "MIXTURE_OR_TASK_MODULE = 'eviltasks'\n"
        )
    )
    monkeypatch.setenv("MOE_JAX_CONFIG_DIR", str(tmp_path / "user"))
    assert cli.main(["analyze", "positions", f"--checkpoint={copy}"]) == 1
    line = _last_line(capsys)
    assert line.startswith(f"moe-jax analyze: error: {config}, line ")
    assert line.endswith(
        ": refusing MIXTURE_OR_TASK_MODULE = 'eviltasks': a run's config may name "
        "only the project's modules or those given on the command line (importing "
        "it would run its code); to trust it, pass "
        f"--gin.MIXTURE_OR_TASK_MODULE=eviltasks, or add it to {tmp_path}/user/trusted_modules "
        "to trust it in every command"
    )
    assert not marker.exists()


def test_a_module_the_user_trusts_once_is_trusted_by_every_command(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.gin").write_text("MIXTURE_OR_TASK_MODULE = 'my_tasks'\n")
    settings = pathlib.Path(RunDir(run_dir).eval_settings_file)
    no_flags = gin_flags.parse_flags(builders.build_parser("t", "t"), [])
    user = tmp_path / "user"
    monkeypatch.setenv("MOE_JAX_CONFIG_DIR", str(user))
    with pytest.raises(config_gate.UntrustedCodeError, match=r"add it to .*/user/trusted_modules"):
        run_config.run_config_file(RunDir(run_dir), no_flags)
    user.mkdir()
    (user / "trusted_modules").write_text("# my own tasks\nmy_tasks\n")
    assert run_config.run_config_file(RunDir(run_dir), no_flags) == str(run_dir / "config.gin")
    config_gate.refuse_untrusted_modules(str(settings), [("module", None, "my_tasks")], no_flags)
    # a trusted module is a name, never a file: a path in the list is refused by line
    (user / "trusted_modules").write_text("my_tasks\n/home/me/my_tasks.py\n")
    with pytest.raises(
        gin_text.GinConfigError,
        match=r"trusted_modules, line 2: '/home/me/my_tasks.py' is not a module name",
    ):
        run_config.run_config_file(RunDir(run_dir), no_flags)
    (run_dir / "config.gin").write_text("MIXTURE_OR_TASK_MODULE = 'my_tasks.py'\n")
    (user / "trusted_modules").write_text("my_tasks\n")
    with pytest.raises(config_gate.UntrustedCodeError, match=r"'my_tasks.py'.*=my_tasks.py$"):
        run_config.run_config_file(RunDir(run_dir), no_flags)


@pytest.mark.parametrize(
    "where, command",
    [
        ("settings", ["eval", "--checkpoint=.", "--eval_steps=1"]),
        ("config", ["eval", "--checkpoint=.", "--eval_steps=1"]),
        ("config", ["eval", "--checkpoint=.", "--eval_steps=1", "--eval_settings=gin"]),
        ("config", ["analyze", "positions", "--checkpoint=."]),
    ],
    ids=["eval_settings", "config_eval", "config_eval_gin", "config_analyze"],
)
def test_a_project_looking_file_in_the_run_folder_never_runs(
    run_and_export, tmp_path, monkeypatch, capsys, where, command
):
    """``moe_jax.payload.py`` beside the run is a file, not a module of the project: a run's
    config or eval settings naming it is refused like any module the command line does not
    name, from inside the run folder too."""
    run, _ = run_and_export
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "moe_jax.payload.py").write_text("open('payload.ran', 'w').write('ran')\n")
    if where == "settings":
        settings = pathlib.Path(RunDir(copy).eval_settings_file)
        settings.write_text(
            settings.read_text().replace('"module": null', '"module": "moe_jax.payload.py"')
        )
    else:
        config = copy / "config.gin"
        config.write_text(
            config.read_text().replace(
                "MIXTURE_OR_TASK_MODULE = None\n",
                "MIXTURE_OR_TASK_MODULE = 'moe_jax.payload.py'\n",
            )
        )
    monkeypatch.chdir(copy)
    assert cli.main(command) == 1
    line = _last_line(capsys)
    assert "refusing" in line and "'moe_jax.payload.py'" in line, line
    assert not (copy / "payload.ran").exists()
    # a module of the installed project still passes the gate
    assert config_gate._is_project_module("moe_jax.data.tasks")
    assert not config_gate._is_project_module("moe_jax.payload.py")


def test_outputs_go_where_the_command_line_says_and_never_replace_another_comparison(
    run_and_export, tmp_path, capsys
):
    run, _ = run_and_export
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "comparison.txt").write_text("mine")
    with open(copy / "config.gin", "a") as f:  # a run's config may say anything
        f.write(f"EVAL_OUTPUT_DIR = {str(victim)!r}\nINFER_OUTPUT_DIR = {str(victim)!r}\n")
    assert cli.main(["eval", f"--checkpoint={copy}", "--eval_steps=1"]) == 0
    assert cli.main(["infer", f"--checkpoint={copy}", "--input=hello"]) == 0
    assert sorted(p.name for p in victim.iterdir()) == ["comparison.txt"]
    assert (victim / "comparison.txt").read_text() == "mine"
    results = copy / "eval_results" / "run"  # the default folder is named by what is compared
    first = (results / "comparison.json").read_text()
    assert list(json.loads(first)) == ["run"]
    # another comparison: its own default folder; into the same folder: refused
    routers = ["eval", f"--checkpoint={copy}", "--eval_steps=1", "--router=learned"]
    assert cli.main([*routers, "--router=random"]) == 0
    assert list(
        json.loads((results.parent / "run.routers-learned+random" / "comparison.json").read_text())
    ) == ["run:learned", "run:random"]
    routers.append(f"--output_dir={results}")
    assert cli.main([*routers, "--router=random"]) == 1
    assert _last_line(capsys) == (
        f"moe-jax eval: error: {results / 'comparison.json'} holds another comparison (run; "
        "this one: run:learned, run:random); pass --overwrite to replace it, or another "
        "--output_dir"
    )
    assert (results / "comparison.json").read_text() == first
    assert cli.main([*routers, "--router=random", "--overwrite"]) == 0
    assert list(json.loads((results / "comparison.json").read_text())) == [
        "run:learned",
        "run:random",
    ]
    # the command line's own EVAL_OUTPUT_DIR is where T5X users expect it
    mine = tmp_path / "mine"
    assert cli.main([*routers[:3], f"--gin.EVAL_OUTPUT_DIR={mine}"]) == 0
    assert (mine / "comparison.json").exists()


def test_an_overwritten_export_keeps_nothing_of_the_old_one_and_import_reads_what_it_lists(
    run_and_export, tmp_path
):
    run, export_dir = run_and_export
    without_routers = tmp_path / "run"
    shutil.copytree(run, without_routers)
    (without_routers / "router_init.npz").unlink()
    out = tmp_path / "export"
    shutil.copytree(export_dir, out)  # an older export with initial routers
    assert (out / "router_init.safetensors").exists()
    assert (
        cli.main(["export", f"--checkpoint={without_routers}", f"--out={out}", "--overwrite"]) == 0
    )
    assert json.loads((out / "config.json").read_text())["router_init"] is None
    assert not (out / "router_init.safetensors").exists()
    # a file config.json does not list is never read: no router_init.npz from a stray file
    stray = tmp_path / "stray"
    shutil.copytree(export_dir, stray)
    config = json.loads((stray / "config.json").read_text())
    (stray / "config.json").write_text(json.dumps({**config, "router_init": None}))
    assert cli.main(["import", f"--export={stray}", f"--model_dir={tmp_path / 'back'}"]) == 0
    assert not (tmp_path / "back" / "router_init.npz").exists()


def test_import_into_a_run_a_trainer_holds_is_refused(run_and_export, tmp_path, capsys):
    run, export_dir = run_and_export
    live = tmp_path / "live"
    shutil.copytree(run, live)
    shutil.rmtree(live / "checkpoints" / str(STEPS))
    own_export = tmp_path / "own_export"
    shutil.copytree(export_dir, own_export)
    config = json.loads((own_export / "config.json").read_text())
    (own_export / "config.json").write_text(json.dumps({**config, "source_checkpoint": str(live)}))
    with run_lock.RunLock(RunDir(live)):  # a trainer of this process holds it
        argv = ["import", f"--export={own_export}", f"--model_dir={live}", "--overwrite"]
        assert cli.main(argv) == 1
        assert "is being written by another trainer" in _last_line(capsys)
    assert sorted(os.listdir(live / "checkpoints")) == []  # the import wrote nothing


def _dead_lock(run_dir: pathlib.Path) -> None:
    """A ``LOCK`` left by a process of this host that no longer runs (kill -9)."""
    import socket
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    record = {"host": socket.gethostname(), "pid": gone.pid, "since": "x", "lease_sec": 120.0}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "LOCK").write_text(json.dumps(record))


def test_an_interrupted_import_is_retried_with_overwrite(run_and_export, tmp_path, capsys):
    """What `import` killed at any point leaves (its dead LOCK, an empty or full
    ``checkpoints/``, a temporary vocabulary file, no config.gin) is not another run: a retry
    is refused as a non-empty folder and `--overwrite` imports into it."""
    _, export_dir = run_and_export
    reference = tmp_path / "reference"
    assert cli.main(["import", f"--export={export_dir}", f"--model_dir={reference}"]) == 0
    for name, full in (("empty", False), ("saved", True)):
        half = tmp_path / name
        if full:  # killed after the checkpoint, before config.gin
            shutil.copytree(reference, half)
            (half / "config.gin").unlink()
        else:
            (half / "checkpoints").mkdir(parents=True)
        _dead_lock(half)
        (half / "vocabulary.model.tmp.host.1.abcdef01").write_bytes(b"\0")
        argv = ["import", f"--export={export_dir}", f"--model_dir={half}"]
        assert cli.main(argv) == 1
        line = _last_line(capsys)
        assert "is not empty" in line and "an interrupted import's" in line, line
        assert cli.main([*argv, "--overwrite"]) == 0, capsys.readouterr().err
        assert (half / "config.gin").read_text() == (reference / "config.gin").read_text().replace(
            str(reference), str(half)
        )
        assert sorted(os.listdir(half / "checkpoints")) == [str(STEPS)]
        assert not (half / "LOCK").exists()


def _rewritten_export(export_dir: pathlib.Path, dest: pathlib.Path, edit) -> pathlib.Path:
    """A copy of ``export_dir`` whose weights / metadata / config.json ``edit(arrays,
    metadata, config)`` changed in place."""
    from safetensors import safe_open
    from safetensors.numpy import load, save

    shutil.copytree(export_dir, dest)
    weights = dest / "model.safetensors"
    arrays = load(weights.read_bytes())
    with safe_open(str(weights), "np") as f:
        metadata = dict(f.metadata())
    config = json.loads((dest / "config.json").read_text())
    edit(arrays, metadata, config)
    weights.write_bytes(save(arrays, metadata=metadata))
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_an_export_that_is_not_what_it_declares_is_not_imported(run_and_export, tmp_path, capsys):
    _, export_dir = run_and_export
    name = "token_embedder/embedding"

    def nan(arrays, metadata, config):
        arrays[name] = arrays[name].copy()
        arrays[name][0, 0] = np.nan

    def half(arrays, metadata, config):
        arrays[name] = arrays[name].astype(np.float16)

    def step(arrays, metadata, config):
        metadata["step"] = "1"

    def other_model(arrays, metadata, config):
        config["t5_config"]["dropout_rate"] = 0.5

    expected = {
        nan: f"array {name!r} holds NaN or Inf (1 of ",
        half: f"array {name!r} has dtype float16 but config.json declares float32",
        step: f"holds step 1 but config.json says step {STEPS}",
        other_model: "describes another network than the export's config.gin (dropout_rate: 0.5 in",
    }
    for edit, message in expected.items():
        bad = _rewritten_export(export_dir, tmp_path / edit.__name__, edit)
        target = tmp_path / f"run_{edit.__name__}"
        assert cli.main(["import", f"--export={bad}", f"--model_dir={target}"]) == 1
        assert message in _last_line(capsys), edit.__name__
        assert not target.exists()


def test_a_second_eval_or_export_into_a_folder_being_written_is_refused(
    run_and_export, tmp_path, capsys
):
    """The check and the writes of `eval` / `export` hold the output folder's lock: a second
    command into the same folder meanwhile is refused, never replaces the first's results."""
    run, _ = run_and_export
    out = tmp_path / "out"
    commands = {
        "eval": ["eval", f"--checkpoint={run}", "--eval_steps=1", f"--output_dir={out}"],
        "export": ["export", f"--checkpoint={run}", f"--out={out}"],
    }
    with output_lock.OutputLock(RunDir(str(out))):  # a first command of this process writes
        for name, argv in commands.items():
            assert cli.main(argv) == 1, name
            line = _last_line(capsys)
            assert f"{out} is being written by another command: host " in line, line
            assert line.endswith("Wait for it to end, or write elsewhere."), line
            assert sorted(os.listdir(out)) == [output_lock.WRITING_FILE]
    assert os.listdir(out) == []  # nothing written; the first command's lock released
    assert cli.main(commands["eval"]) == 0
    assert sorted(os.listdir(out))[:2] == ["comparison.json", "comparison.txt"]
    assert output_lock.WRITING_FILE not in os.listdir(out)


def test_garbage_in_a_run_file_is_one_line_naming_it(run_and_export, tmp_path, capsys):
    run, _ = run_and_export
    garbage = bytes(range(256)) * 4
    lock = tmp_path / "locked"
    lock.mkdir()
    (lock / "LOCK").write_bytes(garbage)
    with pytest.raises(errors.RunLockedError, match=f"its lock {lock / 'LOCK'} expires"):
        run_lock.RunLock(RunDir(str(lock))).acquire()
    os.utime(lock / "LOCK", (1, 1))  # its lease over: taken over like any dead holder's
    taken = run_lock.RunLock(RunDir(str(lock))).acquire()
    assert taken.took_over and taken.took_over["host"] == "?"
    taken.release()
    for name in ("router_init.npz", "eval_settings.json"):
        copy = tmp_path / name
        shutil.copytree(run, copy)
        (copy / name).write_bytes(garbage)
        argv = ["eval", f"--checkpoint={copy}", "--eval_steps=1", f"--output_dir={tmp_path}/o"]
        assert cli.main(argv) == 1
        line = _last_line(capsys)
        assert line.startswith(f"moe-jax eval: error: {copy / name} is unreadable ("), line


def test_a_shadow_package_on_the_path_does_not_decide_what_the_gate_trusts(tmp_path):
    """`PYTHONPATH=.` in a folder holding ``moe_jax/__init__.py`` and ``moe_jax/payload.py``:
    Python imports that ``__init__`` as the package (it runs), but the gate resolves the
    project from its own installed files, so ``moe_jax.payload`` is not a project module."""
    import subprocess
    import sys

    shadow = tmp_path / "moe_jax"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("print('shadow init')\n")
    (shadow / "payload.py").write_text("print('payload ran')\n")
    code = (
        "from moe_jax.runtime import config_gate as g; "
        "print(g._is_project_module('moe_jax.payload'), g._is_project_module('moe_jax.data.tasks'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": "."},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines() == ["shadow init", "False True"], done.stdout


def test_tensorboard_files_are_read_as_tensors(run_and_export):
    """docs/training.md: the run's TensorBoard metrics are TF2 summaries, i.e. tensors;
    `EventAccumulator.Tensors` gives the values `metrics.jsonl` holds, `Scalars` nothing."""
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    run, _ = run_and_export
    events = event_accumulator.EventAccumulator(
        str(run / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    events.Reload()
    assert events.Tags()["scalars"] == [] and "loss" in events.Tags()["tensors"]
    logged = {
        r["step"]: r["loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r.get("split") == "train" and "loss" in r
    }
    read = {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors("loss")}
    assert logged and read.keys() == logged.keys()
    np.testing.assert_allclose(list(read.values()), list(logged.values()), rtol=1e-6)
