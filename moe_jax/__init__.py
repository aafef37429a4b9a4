"""moe-jax: routing in Mixture-of-Experts models, in JAX/Flax.

Packages, from the bottom up; a module imports only from its own layer or those below it,
and no modules import each other in a loop (``tests/core/test_layout.py`` checks both):

  errors, storage, hardware, partitioning, param_paths, plotting
             expected errors; run-directory files (local or gs://); chip facts and the
             XLA options programs compile with; meshes and logical axis rules; parameter
             names; the matplotlib set-up
  moe        the Flax MoE layer and its typed configuration: routers, dispatch, experts,
             expert parallelism, auxiliary losses, router freezing, upcycling
  data       seqio tasks, span corruption, vocabularies, embedded corpus
  synthetic  pure-JAX synthetic routing laboratory (the paper's Sections 2-4, Appendices C-F)
  models     the T5 MoE encoder-decoder
  runtime    the training runtime: gin flags, builders, train step, checkpoints, run lock,
             metrics, evaluation
  compile    ahead-of-time compile for a TPU/GPU/CPU target: targets, the compiled-step
             report, costs and collectives read from compiled HLO, the contention guard
  analysis   routing analyses over checkpoints (positions, languages, counterfactual routers)
  interop    the export format (safetensors + JSON config); Hugging Face T5 / Switch
             Transformers checkpoints; ``moe_jax.load`` for notebooks
  commands   the `moe-jax` binaries (train, eval, infer, compile, export / import, upcycle,
             analyze)
  experiments  tooling over many runs: sweeps and routing comparisons
  cli, smoke the `moe-jax` entry point and the README's main job
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``moe_jax.load`` (:func:`moe_jax.interop.notebook.load`), imported on first use so
    that ``import moe_jax`` stays light (a module above every layer, by name)."""
    if name == "load":
        import importlib

        return importlib.import_module("moe_jax.interop.notebook").load
    raise AttributeError(f"module 'moe_jax' has no attribute {name!r}")
