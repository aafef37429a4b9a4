"""The experiments. A module holds one experiment (or two that share a setting); it exposes
``EXPERIMENTS: dict[str, common.Experiment]`` (description, presets, ``run``).

Modules are imported lazily so that ``moe-jax synthetic --help`` stays cheap and only
``cifar100`` ever imports TensorFlow.
"""

from __future__ import annotations

import importlib

from moe_jax.synthetic.experiments.common import Experiment

# CLI name -> module (under moe_jax.synthetic.experiments)
EXPERIMENTS: dict[str, str] = {
    "fig2": "fig2",
    "fig3": "mixture_mlp",
    "fig4": "mixture_mlp",
    "spurious": "spurious",
    "theorem2": "theorem2",
    "lemma1": "lemma1",
    "theorem4": "theorem4",
    "tokenized": "tokenized",
    "fig6": "fig6",
    "theorem1": "spurious",
    "dictionary": "dictionary",
    "cifar100": "cifar100",
    "chen2022": "chen2022",
    "mmoe": "mmoe",
}

# `moe-jax synthetic all` runs these (cifar100 needs the downloaded dataset)
SUITE: tuple[str, ...] = tuple(name for name in EXPERIMENTS if name != "cifar100")


def load(name: str) -> Experiment:
    """The experiment called ``name`` (its module is imported now)."""
    if name not in EXPERIMENTS:
        raise ValueError(
            f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)} or 'all'"
        )
    return importlib.import_module(f"{__name__}.{EXPERIMENTS[name]}").EXPERIMENTS[name]
