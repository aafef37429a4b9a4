"""Synthetic routing laboratory: the synthetic experiments and theorems of
"On the Benefits of Learning to Route in Mixture-of-Experts Models", in pure JAX + optax.

Modules, one job each:
  data        task generators (mixtures of Gaussians / subspaces, tokenized, dictionary,
              truncated Gaussians), deterministic from a PRNG key and jit-able
  routers     linear, depth-3 MLP and CNN routers; learned / frozen / shuffled / data-init
  experts     constant, linear and depth-3 MLP experts, stacked over a leading expert axis
  models      the soft MoE (top-1 at evaluation) and the dense baselines
  train       one training loop (optax, vmapped over runs, chunked lax.scan + tqdm)
  metrics     normalised loss, per-cluster sparsity, spurious ratio, norm uniformity, purity
  experiments one module per CLI experiment
  cli         `moe-jax synthetic <name>`: runs one experiment (or the suite) into a folder
  report      `moe-jax synthetic report`: the fidelity table against the paper's numbers

Nothing here imports TensorFlow except the `cifar100` experiment, lazily.
"""
