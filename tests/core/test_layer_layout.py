"""One parameter layout outside the model: every tree outside ``moe_jax.models`` is per
layer (``encoder/layers_3/...``). Only the models, the checkpoint boundary
(``runtime/checkpoints.py``, which writes per layer and reads older stacked checkpoints)
and the reader of a run's initial routers (``runtime/router_init.py``, whose older files
may be stacked) import ``layer_stacking``; everything else converts through
``Model.per_layer`` / ``own_layout``. Read from the source's import graph."""

from __future__ import annotations

from tests.core.test_layout import GRAPH

LAYER_STACKING = "moe_jax.models.layer_stacking"
BOUNDARY = frozenset({"moe_jax.runtime.checkpoints", "moe_jax.runtime.router_init"})


def test_only_the_models_and_the_checkpoint_boundary_import_layer_stacking():
    importers = {name for name, targets in GRAPH.items() if LAYER_STACKING in targets}
    outside = sorted(
        name
        for name in importers
        if not name.startswith("moe_jax.models.") and name not in BOUNDARY
    )
    assert outside == []
    assert importers >= BOUNDARY | {"moe_jax.models.model", "moe_jax.models.t5"}
