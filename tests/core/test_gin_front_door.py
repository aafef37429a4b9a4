"""Gin only at the front door: the library modules import no gin, and one module
(``moe_jax.runtime.configured``) registers every name the gin files bind, each under the
module it has always had, classes in place (gin builds the library's own class)."""

from __future__ import annotations

import ast
import pathlib

import gin
import pytest

from moe_jax.models.t5 import T5Config
from moe_jax.moe import config as moe_config
from moe_jax.moe.config import MoeConfig, TopKRouterConfig
from moe_jax.runtime import builders, configured

PACKAGE = pathlib.Path(configured.__file__).resolve().parents[1]

# The modules that may import gin: the front door (it registers the names and reads what
# gin chooses, and parses, gates and flags gin text) and the commands with their own
# settings (``eval_script.evaluate.*``, ``export_script.*``, the analyses' ``*_script.*``).
FRONT_DOOR = {
    "runtime/configured.py",
    "runtime/gin_utils.py",
    "runtime/gin_text.py",
    "runtime/config_gate.py",
    "runtime/run_config.py",
    "commands/analyze.py",
    "commands/evaluate.py",
    "commands/export.py",
    "commands/import_run.py",
    "commands/infer.py",
    "commands/upcycle.py",
    "compile/aot.py",
    "analysis/coactivation.py",
    "analysis/languages.py",
    "analysis/positions.py",
    "analysis/saturation.py",
    "analysis/trace.py",
    "analysis/vocabulary.py",
}


def _imports_gin(path: pathlib.Path) -> bool:
    """Whether the module at ``path`` imports gin anywhere (top level or in a function)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(
            a.name == "gin" or a.name.startswith("gin.") for a in node.names
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] == "gin"
        ):
            return True
    return False


def test_only_the_front_door_imports_gin():
    importing = {
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if _imports_gin(path)
    }
    assert importing - FRONT_DOOR == set(), "library modules importing gin"
    assert FRONT_DOOR - importing == set(), "FRONT_DOOR lists modules that no longer need gin"


def test_the_check_sees_every_form_of_import(tmp_path):
    for text in ("import gin\n", "from gin import config\n", "def f():\n    import gin.config\n"):
        (tmp_path / "m.py").write_text(text)
        assert _imports_gin(tmp_path / "m.py"), text
    (tmp_path / "m.py").write_text("import ginkgo\nfrom .gin import x\n")
    assert not _imports_gin(tmp_path / "m.py")


@pytest.mark.parametrize(
    "name, selector",
    [
        ("MoeConfig", "moe_jax.moe.config.MoeConfig"),
        ("T5Config", "moe_jax.models.t5.T5Config"),
        ("EncoderDecoderModel", "moe_jax.models.model.EncoderDecoderModel"),
        ("utils.DatasetConfig", "utils.DatasetConfig"),
        ("sources.make_source", "moe_jax.data.sources.make_source"),
        ("vocab.get_vocabulary", "moe_jax.data.vocab.get_vocabulary"),
        ("pipeline.get_dataset", "moe_jax.data.pipeline.get_dataset"),
        ("freeze.router_mode", "moe_jax.moe.freeze.router_mode"),
        ("freeze.bias_mode", "moe_jax.moe.freeze.bias_mode"),
        (
            "partitioning.standard_logical_axis_rules",
            "moe_jax.partitioning.standard_logical_axis_rules",
        ),
        ("peak_flops_per_device", "moe_jax.runtime.throughput.peak_flops_per_device"),
        ("WandbSettings", "moe_jax.runtime.wandb_logger.WandbSettings"),
        ("partitioning.make_mesh", "moe_jax.partitioning.make_mesh"),
        ("train_script.train", "train_script.train"),
    ],
)
def test_every_name_keeps_its_module(name, selector):
    assert gin.config._REGISTRY.get_match(name).selector == selector


def test_gin_builds_the_library_classes_themselves():
    gin.clear_config()
    try:
        gin.parse_config(
            [
                "MoeConfig.num_experts = 4",
                "MoeConfig.router = @TopKRouterConfig()",
                "train/utils.DatasetConfig.batch_size = 2",
                "T5Config.moe = @MoeConfig()",
            ]
        )
        config = T5Config()
        with gin.config_scope("train"):
            dataset = builders.DatasetConfig("task", {"inputs": 8, "targets": 4}, "train")
    finally:
        gin.clear_config()
    assert type(config) is T5Config and type(config.moe) is MoeConfig
    assert type(config.moe.router) is TopKRouterConfig and config.moe.num_experts == 4
    assert type(dataset) is builders.DatasetConfig and dataset.batch_size == 2
    # equal to the same value built without gin: dataclass equality holds across the two
    assert config.moe == moe_config.from_dict(config.moe.to_dict())


def test_every_gin_file_parses_with_plain_gin_in_a_fresh_process():
    """The model, data, router and mesh files of ``gin/`` import ``moe_jax.runtime.configured``
    themselves, so plain gin (a notebook's ``gin.parse_config_file``, nothing of moe-jax
    imported first) knows every name they bind; an unknown configurable would fail the
    parse. (A command's own defaults, ``gin/analysis/*.gin`` and ``gin/runs/*.gin``, are
    read by that command, which has registered its settings.)"""
    import subprocess
    import sys

    repo = PACKAGE.parent
    files = sorted(
        str(p.relative_to(repo))
        for p in (repo / "gin").rglob("*.gin")
        if p.parent.name not in ("analysis", "runs")
    )
    code = (
        "import sys, gin\n"
        "gin.add_config_file_search_path(sys.argv[1])\n"
        "for path in sys.argv[2:]:\n"
        "    gin.clear_config()\n"
        "    gin.parse_config_file(path)\n"
        "print(len(sys.argv) - 2)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(repo), *files],
        check=False,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(len(files)) and len(files) > 30
