"""How a checkpoint writes a replicated array: from one replica in one process."""

from __future__ import annotations

import logging

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.runtime import checkpoints


def _slices_compiled(path, array: jax.Array, caplog) -> int:
    """Programs compiled while ``array`` is saved under ``path`` that slice it."""
    caplog.clear()
    was = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING), ocp.StandardCheckpointer() as saver:
            saver.save(path, {"x": array})
            saver.wait_until_finished()
    finally:
        jax.config.update("jax_log_compiles", was)
    return sum("Compiling jit(slice)" in r.getMessage() for r in caplog.records)


def test_one_process_saves_a_replicated_array_without_slicing_it(tmp_path, caplog):
    """Orbax's default (replica-parallel) saves a slice of a replicated array from each of
    its 8 CPU devices: an eager slicing program per device and array. In one process the
    checkpointer's handler writes it whole from one replica; the values round-trip."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    # shapes of this test only: a slicing program compiled before would not be logged
    first, second = (np.arange(8 * n, dtype=np.float32).reshape(8, n) + 0.5 for n in (24, 40))
    replicated = NamedSharding(mesh, P())
    registered = ocp.type_handlers.get_type_handler(jax.Array)  # put back at the end
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(), override=True
        )  # orbax's default
        saved = jax.device_put(first, replicated)
        assert _slices_compiled(tmp_path / "orbax_default", saved, caplog) == 8
        checkpoints.register_array_handler()
        saved = jax.device_put(second, replicated)
        assert _slices_compiled(tmp_path / "registered", saved, caplog) == 0
    finally:
        ocp.type_handlers.register_type_handler(jax.Array, registered, override=True)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "registered")
    np.testing.assert_array_equal(np.asarray(restored["x"]), second)
