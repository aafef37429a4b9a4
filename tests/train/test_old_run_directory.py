"""A run directory of the unreleased development snapshots of 2026-11-21..25 (its config.gin
binds ``MoeLayer.*``, the MoE settings before ``MoeConfig``) is not read: each command says
so in one line naming the run's config.gin, the line and the binding, and a resumption with
the current gin files is refused the same way (CHANGELOG.md, [Unreleased], Removed)."""

from __future__ import annotations

import pathlib

import pytest

from moe_jax import cli
from moe_jax.runtime import gin_utils, run_config
from moe_jax.runtime.run_dir import RunDir

# The head of such a run's config.gin (as the snapshots wrote it: imports, macros, then one
# block of bindings per configurable).
OLD_CONFIG = """\
import moe_jax.models.t5 as moe_jax2
import moe_jax.moe as moe_jax3
import moe_jax.moe.layer as moe_jax4

# Macros:
# ==============================================================================
NUM_EXPERTS = 4

# Parameters for MoeLayer:
# ==============================================================================
MoeLayer.accept_causal_leak = False
MoeLayer.num_experts = %NUM_EXPERTS
"""
LINE = 11  # of MoeLayer.accept_causal_leak


def _old_run(tmp_path: pathlib.Path) -> pathlib.Path:
    run = tmp_path / "old_run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "config.gin").write_text(OLD_CONFIG)
    return run


@pytest.mark.parametrize("command", ["eval", "infer"])
def test_an_old_run_is_refused_in_one_line_naming_its_config_and_binding(tmp_path, capsys, command):
    run = _old_run(tmp_path)
    out = tmp_path / "out"
    flags = [f"--checkpoint={run}", f"--output_dir={out}"]
    if command == "infer":
        flags = [f"--checkpoint={run}", "--input=x"]
    assert cli.main([command, *flags]) not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert (
        f"{run / 'config.gin'}, line {LINE}: `MoeLayer.accept_causal_leak = False`: "
        "no configurable 'MoeLayer' in this version" in line
    )
    assert "2026-11-21..25" in line and "train the run again" in line


def test_train_with_the_old_run_as_gin_file_is_refused_the_same_way(tmp_path, capsys):
    run = _old_run(tmp_path)
    assert cli.main(["train", f"--gin_file={run / 'config.gin'}"]) not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert f"{run / 'config.gin'}, line {LINE}: `MoeLayer.accept_causal_leak" in line


def test_resuming_an_old_run_with_the_current_gin_files_is_refused_unless_allowed(tmp_path):
    """The recorded config binds a configurable this version lacks, so it cannot be compared
    with the operative one: refused, naming the file, line and binding; with
    ``--allow_config_change`` the run resumes with the current config, kept with the
    unknown configurable listed as changed."""
    gin_utils.import_configurables()
    run = RunDir(str(_old_run(tmp_path)))
    operative = "MoeConfig.num_experts = 4\n"
    with pytest.raises(run_config.ConfigChangedError) as err:
        run_config.record_run_config(run, operative, 3)
    message = str(err.value)
    assert "\n" not in message
    assert f"{run.config_file}, line {LINE}: `MoeLayer.accept_causal_leak = False`" in message
    assert "--allow_config_change" in message
    kept = run_config.record_run_config(run, operative, 3, allow_change=True)
    assert kept == run.accepted_config_file(3)
    text = pathlib.Path(kept).read_text()
    assert "#   MoeLayer.*: no such configurable in this version\n" in text
    assert text.endswith(operative)
    # from now on the run is compared with the kept config: a plain resume goes on
    assert run_config.record_run_config(run, operative, 3) == kept
