"""The run as a typed value: :class:`RunSpec` built once from gin (every name the gin files
bind fills its field), written as ``MODEL_DIR/run.json``, read back exactly, compared field
by field."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib

import gin
import pytest

from moe_jax.commands import analyze
from moe_jax.data import sources, vocab
from moe_jax.runtime import (
    builders,
    configured,
    gin_flags,
    gin_text,
    gin_utils,
    optimizers,
    run_config,
    run_spec,
)
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.run_spec import RunSpec
from tests.train.test_train import run


def spec_of(*flags: str) -> RunSpec:
    """The spec the smoke config (with ``flags``) describes."""
    args = gin_flags.parse_flags(
        builders.build_parser("test", "test"),
        ["--gin_file=runs/smoke_cpu.gin", "--gin.MODEL_DIR=/tmp/unused", *flags],
    )
    gin_utils.parse_gin(args)
    return configured.train_spec()[0]


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--gin_file=routers/aux_free_bias.gin", "--gin_file=routers/frozen_bias.gin"),
        ("--gin_file=routers/frozen.gin", "--gin_file=meshes/cpu_8.gin"),
        ("--gin_file=routers/hierarchical.gin", "--gin.train_script.train.profile_steps=[2, 3]"),
        ("--gin.create_optimizer.learning_rate=0.25", "--gin.create_optimizer.name='sgd'"),
    ],
)
def test_json_round_trip_is_exact(flags):
    spec = spec_of(*flags)
    assert RunSpec.from_json(spec.to_json()) == spec
    assert run_spec.diff(spec, RunSpec.from_json(spec.to_json())) == []


def test_every_gin_name_fills_its_field():
    spec = spec_of(
        "--gin_file=routers/frozen.gin",
        "--gin_file=meshes/cpu_8.gin",
        "--gin.train_script.train.checkpoint_period=7",
        "--gin.train_script.train.keep_checkpoints=None",
        "--gin.train_script.train.routing_churn=False",
        "--gin.RANDOM_SEED=5",
        "--gin.learning_rate_schedule.warmup_steps=11",
        "--gin.T5Config.dropout_rate=0.25",
        "--gin.CapacityConfig.group_size=128",
    )
    assert spec.loop.checkpoint == run_spec.CheckpointSettings(period=7, keep=None)
    assert spec.loop.eval == run_spec.EvalSettings(period=150, steps=8, routing_churn=False)
    assert (spec.loop.total_steps, spec.loop.log_period) == (300, 25)
    assert spec.seed == 5 and spec.data.train.seed == 5
    assert spec.router_mode == "frozen" and spec.bias_mode == "updated"
    assert spec.mesh.mesh_shape == (2, 4, 1) and spec.mesh.max_expert_partitions == 4
    assert spec.optimizer.name == "adam"
    assert spec.optimizer.learning_rate == run_spec.ScheduleSpec(3e-3, 11, "cosine", 300, 3e-4)
    assert spec.model.network.dropout_rate == 0.25
    assert spec.model.network.moe.capacity.group_size == 128
    assert spec.model.vocabulary == run_spec.VocabularySpec("embedded", None, 100)
    assert spec.data.eval.split == "validation"
    assert spec.data.source["corpus"] == "embedded"


@pytest.mark.parametrize(
    "spec_type, function",
    [
        (run_spec.OptimizerSpec, optimizers.create_optimizer),
        (run_spec.ScheduleSpec, optimizers.learning_rate_schedule),
    ],
)
def test_optimizer_specs_take_every_argument_of_their_function(spec_type, function):
    fields = [f.name for f in dataclasses.fields(spec_type)]
    assert fields == list(inspect.signature(function).parameters)


def test_diff_names_dotted_field_paths():
    spec = spec_of()
    network = dataclasses.replace(spec.model.network, emb_dim=64)
    changed = dataclasses.replace(
        spec,
        model=dataclasses.replace(spec.model, network=network),
        loop=dataclasses.replace(
            spec.loop, checkpoint=dataclasses.replace(spec.loop.checkpoint, period=9)
        ),
    )
    assert run_spec.diff(spec, changed) == [
        ("model.network.emb_dim", 32, 64),
        ("loop.checkpoint.period", 100, 9),
    ]
    assert [run_spec.resumable(path) for path, _, _ in run_spec.diff(spec, changed)] == [
        False,
        True,
    ]


def test_model_spec_builds_its_model_and_reads_alone():
    spec = spec_of()
    built = spec.model.build()
    assert built.module.config == spec.model.network
    assert (built.z_loss, built.vocab_size) == (1e-4, 8100)
    assert run_spec.model_from_dict(spec.to_dict()) == spec.model


def test_train_records_run_json_and_resumes_comparing_fields(tmp_path):
    run(tmp_path, 3)
    recorded = RunSpec.from_json((tmp_path / "run.json").read_text())
    assert recorded.loop.total_steps == 3 and recorded.loop.checkpoint.period == 3
    assert recorded.data.train.batch_size == 8
    assert recorded.model.network.moe.num_experts == 4
    # an unchanged run (its length and periods aside) resumes, and records nothing new
    assert run(tmp_path, 6, "--gin.train_script.train.log_period=3")["step"] == 6
    assert sorted(p.name for p in tmp_path.glob("run*.json")) == ["run.json"]
    # a changed field is refused, named by its path
    with pytest.raises(
        run_config.ConfigChangedError,
        match=r"(?s)resuming at step 6 would change 2 field\(s\).*\n"
        r"  model.network.dropout_rate: 0.0 -> 0.25\n"
        r"  model.network.moe.capacity.train_capacity_factor: 1.25 -> 2.0$",
    ):
        run(tmp_path, 9, "--gin.T5Config.dropout_rate=0.25", "--gin.TRAIN_CAPACITY_FACTOR=2.0")
    assert RunDir(tmp_path).reached_step() == 6


def test_a_run_without_run_json_resumes_by_its_gin_text_then_gets_one(tmp_path):
    """A run an older version started has config.gin and no run.json: its first resumption
    compares gin text as that version did, then records the spec from that step on."""
    run(tmp_path, 3)
    (tmp_path / "run.json").unlink()
    with pytest.raises(
        run_config.ConfigChangedError,
        match=r"would change 1 binding.*\n  learning_rate_schedule.base_learning_rate: "
        r"0.003 -> 0.5",
    ):
        run(tmp_path, 6, "--gin.learning_rate_schedule.base_learning_rate=0.5")
    assert not list(tmp_path.glob("run*.json"))
    assert run(tmp_path, 6)["step"] == 6
    assert sorted(p.name for p in tmp_path.glob("run*.json")) == ["run.step-3.json"]
    assert RunDir(tmp_path).recorded_spec(2) is None  # step 2 was trained before the spec
    with pytest.raises(run_config.ConfigChangedError, match=r"run.step-3.json.*1 field"):
        run(tmp_path, 9, "--gin.learning_rate_schedule.base_learning_rate=0.5")


def _eval_model(capsys, checkpoint, *flags: str):
    """The model `moe-jax eval --checkpoint=checkpoint flags` evaluates (gin parsed as the
    command parses it) and what it said on stderr."""
    args = gin_flags.parse_flags(builders.build_parser("t", "t"), list(flags))
    args.gin_file = run_config.run_gin_files(args, str(checkpoint), ["runs/eval.gin"])
    gin_utils.parse_gin(args)
    return gin.get_bindings("eval_script.evaluate")["model"], capsys.readouterr().err


def test_commands_read_the_model_from_the_run_spec(tmp_path, capsys):
    """A run's model is its spec's (run.json as of the checkpoint's step), not what its
    config.gin builds; a command line that binds anything builds it from gin instead."""
    spec = spec_of()
    (tmp_path / "config.gin").write_text(gin_utils.operative_config())
    for step in (3, 5):
        (tmp_path / f"checkpoints/{step}").mkdir(parents=True)
    for name, rate in (("run.json", 0.5), ("run.step-5.json", 0.25)):
        network = dataclasses.replace(spec.model.network, dropout_rate=rate)
        recorded = dataclasses.replace(spec, model=dataclasses.replace(spec.model, network=network))
        (tmp_path / name).write_text(recorded.to_json())
    model, err = _eval_model(capsys, tmp_path / "checkpoints/3")
    assert model.module.config.dropout_rate == 0.5
    assert f"model: the run's {tmp_path / 'run.json'}" in err
    model, err = _eval_model(capsys, tmp_path)  # the latest step, 5
    assert model.module.config.dropout_rate == 0.25
    assert f"model: the run's {tmp_path / 'run.step-5.json'}" in err
    model, err = _eval_model(capsys, tmp_path, "--gin.DROPOUT_RATE=0.125")
    assert model.module.config.dropout_rate == 0.125 and "model:" not in err


def test_commands_read_the_data_from_the_run_spec(tmp_path, capsys):
    """A run's data (its raw-text source, vocabulary, task, feature lengths and batch size)
    is its spec's too, whatever its config.gin says; a command-line binding reads the config
    instead."""
    spec = spec_of()
    (tmp_path / "config.gin").write_text(gin_utils.operative_config())
    (tmp_path / "checkpoints/3").mkdir(parents=True)
    source = {**spec.data.source, "corpus": "text", "train_patterns": {"en": "/data/en/*.txt"}}
    train = dataclasses.replace(
        spec.data.train,
        mixture_or_task_name="text_en_span_corruption",
        task_feature_lengths={"inputs": 16, "targets": 4},
        batch_size=2,
    )
    model = dataclasses.replace(spec.model, vocabulary=run_spec.VocabularySpec("byte", None, 7))
    recorded = dataclasses.replace(
        spec, model=model, data=dataclasses.replace(spec.data, train=train, source=source)
    )
    (tmp_path / "run.json").write_text(recorded.to_json())
    _eval_model(capsys, tmp_path)
    dataset = gin.get_bindings("eval_script.evaluate")["dataset_cfg"]
    assert (dataset.mixture_or_task_name, dataset.batch_size) == ("text_en_span_corruption", 2)
    assert dict(dataset.task_feature_lengths) == {"inputs": 16, "targets": 4}
    assert dataset.split == "validation"  # the command's own setting (runs/eval.gin)
    assert sources.make_source_settings()["train_patterns"] == {"en": "/data/en/*.txt"}
    assert sources.corpus_groups() == ("en",)
    assert vocab.selected_vocabulary().vocab_size == 256 + 3 + 7  # bytes, specials, sentinels
    _eval_model(capsys, tmp_path, "--gin.EVAL_OUTPUT_DIR='/tmp/unused'")
    dataset = gin.get_bindings("eval_script.evaluate")["dataset_cfg"]
    assert dataset.mixture_or_task_name == spec.data.train.mixture_or_task_name
    assert sources.make_source_settings()["corpus"] == spec.data.source["corpus"] == "embedded"


GIN_FILES = sorted(
    str(path.relative_to(gin_text.REPO_GIN_DIR)) for path in gin_text.REPO_GIN_DIR.rglob("*.gin")
)


# What a file needs besides the smoke config: the values it leaves to the user.
NEEDS = {
    "data/text.gin": ("--gin.TEXT_TRAIN_FILES='/tmp/unused/*.txt'",),
    "runs/pretrain.gin": ("--gin.TRAIN_STEPS=10",),
    "routers/expert_choice.gin": ("--gin.MoeConfig.accept_causal_leak=True",),
}


@pytest.mark.parametrize("gin_file", GIN_FILES)
def test_every_gin_file_parses_and_builds_a_run_spec(gin_file):
    """Each of the project's gin files, read after the smoke config, binds only registered
    names and gives a spec that round-trips through ``run.json`` (the analyses' files once
    ``moe-jax analyze`` has imported their module)."""
    if gin_file.startswith("analysis/"):
        importlib.import_module(analyze.ANALYSES[pathlib.Path(gin_file).stem][0])
    spec = spec_of(f"--gin_file={gin_file}", *NEEDS.get(gin_file, ()))
    assert RunSpec.from_json(spec.to_json()) == spec
