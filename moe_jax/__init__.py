"""moe-jax: routing in Mixture-of-Experts models, in JAX/Flax.

Subpackages (each one job):
  synthetic  pure-JAX synthetic routing laboratory (the paper's Sections 2-4, Appendices C-F)
  moe        the Flax MoE layer: routers, dispatch, experts, auxiliary losses
  models     the T5 MoE encoder-decoder
  data       seqio tasks, span corruption, vocabularies, embedded corpus
  train      train / eval / infer binaries, checkpoints, multi-host
"""

__version__ = "0.1.0"
