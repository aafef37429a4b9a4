"""Names of the Flax variable collections of the MoE layer: defined here once, used as these
constants by the layer, the model, the train step and the analyses."""

from __future__ import annotations

# Sown: each auxiliary loss times its ``AuxLossConfig`` weight (a loss of weight 0 is not
# sown); the model adds every leaf to the training loss.
AUX_LOSS_COLLECTION = "aux_loss"
# Sown: the unweighted auxiliary losses and the routing statistics (``losses.py``).
MOE_METRICS_COLLECTION = "moe_metrics"
# State, not a parameter: the auxiliary-loss-free balancing bias ``[experts]`` of
# ``TopKRouterConfig.bias_update_rate`` (``selection.py``), updated by the training forward pass.
BIAS_COLLECTION = "router_bias"
# Sown only when the caller makes it mutable: per-token routing for analyses
# (``MoeLayer._sow_routing``).
ROUTING_COLLECTION = "routing"
