"""Routing analyses over trained checkpoints (`moe-jax analyze <analysis>`, `moe-jax eval
--router=NAME`), built on :mod:`moe_jax.runtime` (its ``routing`` module collects each MoE
layer's per-token routing).

  positions       positional routing statistics (Bershatsky & Oseledets): activation rate
                  by position, correlation length of expert sequences, position probes
  languages       languages (or any labelled groups) as latent clusters: mutual information
                  between label and expert, sparsity per cluster
  counterfactual  the same weights evaluated with the routers replaced
  plots           the PNGs of those statistics
  trace           per-token routing records (arrays and Parquet) of one or many checkpoints
  vocabulary      token-id and token-category specialisation (OpenMoE, OLMoE, ST-MoE)
  saturation      agreement of each checkpoint's routing with the final one's (OLMoE)
  coactivation    expert pair co-activation, cross-layer routing consistency (OLMoE)
  seeds           mean and spread of any statistic over a run family's seeds
  trace_plots     the PNGs of the trace analyses
See docs/analysis.md.
"""
