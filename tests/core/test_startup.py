"""What every `moe-jax` command sets up before it runs: the persistent compilation cache and
a scratch temporary folder."""

from __future__ import annotations

import os
import tempfile

from moe_jax import cli
from moe_jax.runtime import scratch


def test_compilation_cache_defaults_to_the_users_cache_folder():
    env = {"XDG_CACHE_HOME": "/home/u/.cache"}
    assert cli.compilation_cache_dir(env) == "/home/u/.cache/moe-jax/jax"
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/home/u/.cache/moe-jax/jax"  # and children
    home = {"HOME": "/home/v"}
    assert cli.compilation_cache_dir(home) == os.path.join(
        os.path.expanduser("~"), ".cache", "moe-jax", "jax"
    )


def test_a_users_cache_folder_wins_and_the_cache_can_be_turned_off():
    mine = {"JAX_COMPILATION_CACHE_DIR": "/fast/jax", "XDG_CACHE_HOME": "/x"}
    assert cli.compilation_cache_dir(mine) == "/fast/jax"
    for off, command in [({cli.CACHE_SWITCH: "0", **mine}, "train"), (dict(mine), "compile")]:
        # `moe-jax compile` reports how long its steps take to compile: never a cache load
        assert cli.compilation_cache_dir(off, command) is None, command
        assert off["JAX_ENABLE_COMPILATION_CACHE"] == "false", command


def test_scratch_folder_takes_temporary_files_and_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with scratch.scratch_tempdir() as folder:
        with tempfile.NamedTemporaryFile(delete=False, suffix=".py") as left:  # as autograph
            pass
        assert os.path.dirname(left.name) == folder and scratch.outer_tempdir() == str(tmp_path)
    assert not os.path.exists(folder) and os.listdir(tmp_path) == []
    assert tempfile.gettempdir() == str(tmp_path)


def _tensorflow_imported_quietly(level: str | None) -> bool:
    """Whether `quiet_startup("train")` imports TensorFlow (its C++ lines hidden) in a fresh
    interpreter whose TF_CPP_MIN_LOG_LEVEL is ``level``."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    code = "import sys; from moe_jax import cli; cli.quiet_startup('train', []); "
    code += "print('tensorflow' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip() == "True"


def test_a_sweeps_trainings_start_as_quietly_as_a_plain_train():
    """`moe-jax sweep` sets TF_CPP_MIN_LOG_LEVEL=2 and its trainings inherit it: they still
    import TensorFlow with its output hidden (no cuInit error); a level of the user's own
    shows TensorFlow's lines."""
    assert _tensorflow_imported_quietly(None)
    assert _tensorflow_imported_quietly(cli.QUIET_ENV["TF_CPP_MIN_LOG_LEVEL"])
    assert not _tensorflow_imported_quietly("0")


def test_an_unusable_cache_folder_leaves_no_traceback_at_exit(tmp_path):
    """With XDG_CACHE_HOME a file, matplotlib cannot make its cache folder: it is pointed at
    one outside the scratch folder, so nothing fails at exit when it cleans up."""
    import subprocess
    import sys

    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    code = (
        "from moe_jax.runtime import scratch\n"
        "from moe_jax import plotting\n"
        "with scratch.scratch_tempdir():\n"
        f"    plotting.pyplot().figure().savefig({str(tmp_path / 'a.png')!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MPLCONFIGDIR"}
    env.update(XDG_CACHE_HOME=str(not_a_folder), TMPDIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert (tmp_path / "a.png").exists() and (tmp_path / "moe_jax_matplotlib").is_dir()
