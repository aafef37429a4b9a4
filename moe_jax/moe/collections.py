"""Names of the Flax variable collections of the MoE layer: defined here once, used as these
constants by the layer, the model, the train step and the analyses."""

from __future__ import annotations

# Sown: each auxiliary loss times its ``AuxLossConfig`` weight (a loss of weight 0 is not
# sown); the model adds every leaf to the training loss.
AUX_LOSS_COLLECTION = "aux_loss"
# Sown: the unweighted auxiliary losses and the routing statistics (``losses.py``).
MOE_METRICS_COLLECTION = "moe_metrics"
# Sown with ``AuxLossConfig.router_losses='hf_stack'``: each MoE layer's per-sequence sums of
# its router logits (``losses.sequence_router_sums``); the model forms each stack's losses
# from them (``losses.hf_stack_losses``).
ROUTER_STACK_COLLECTION = "router_stack"
# State, not a parameter: the auxiliary-loss-free balancing bias ``[experts]`` of
# ``TopKRouterConfig.bias_update_rate`` (``selection.py``), updated by the training forward pass.
BIAS_COLLECTION = "router_bias"
# Sown only when the caller makes it mutable: per-token routing for analyses
# (``MoeLayer._sow_routing``).
ROUTING_COLLECTION = "routing"
