"""Test helper: undo span corruption on one example of a batch."""

from __future__ import annotations

import numpy as np

from moe_jax.data import vocab


def original_tokens(batch: dict[str, np.ndarray]) -> list[int]:
    """Row 0's original tokens: inputs with each sentinel replaced by the target span that
    follows the same sentinel in ``decoder_target_tokens`` (pad 0 and EOS 1 dropped)."""
    size = vocab.selected_vocabulary().vocab_size
    inputs = batch["encoder_input_tokens"][0]
    targets = batch["decoder_target_tokens"][0]
    fills, key = {}, None
    for t in targets[targets > 1].tolist():
        if t >= size - 100:
            key = t
            fills[key] = []
        else:
            fills[key].append(t)
    return [x for t in inputs[inputs > 1].tolist() for x in (fills[t] if t >= size - 100 else [t])]
