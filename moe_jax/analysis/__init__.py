"""Routing analyses over trained checkpoints (`moe-jax analyze <analysis>`).

  ``routing.py``    restore a checkpoint, run the eval data through it, collect each MoE
                    layer's per-token routing (the layer's opt-in ``routing`` collection)
  ``positions.py``  positional routing statistics (Bershatsky & Oseledets): activation
                    rate by position, correlation length of expert sequences, position probes
  ``languages.py``  languages (or any labelled groups) as latent clusters: mutual
                    information between label and expert, sparsity per cluster
                    (``moe-jax analyze languages``)
  ``counterfactual.py``  the same weights evaluated with the routers replaced
                    (``moe-jax eval --router=NAME``)
  ``plots.py``      the PNGs of those statistics
  ``cli.py``        argument parsing and dispatch
See docs/analysis.md.
"""
