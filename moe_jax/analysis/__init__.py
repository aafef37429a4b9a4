"""Routing analyses over trained checkpoints (`moe-jax analyze <analysis>`, `moe-jax eval
--router=NAME`), built on :mod:`moe_jax.runtime` (its ``routing`` module collects each MoE
layer's per-token routing).

  positions       positional routing statistics (Bershatsky & Oseledets): activation rate
                  by position, correlation length of expert sequences, position probes
  languages       languages (or any labelled groups) as latent clusters: mutual information
                  between label and expert, sparsity per cluster
  counterfactual  the same weights evaluated with the routers replaced
  plots           the PNGs of those statistics
See docs/analysis.md.
"""
