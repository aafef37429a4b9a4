"""`moe-jax infer`'s inputs: what is read of an input longer than the task's length is said."""

from __future__ import annotations

import numpy as np

from moe_jax.commands import infer
from moe_jax.data import vocab


def test_an_input_cut_to_the_task_length_is_said(capsys):
    vocabulary = vocab.selected_vocabulary()
    long, short = "Everyone has the right to life. " * 300, "hello"
    tokens = infer.encode_inputs([short, long], vocabulary, 32, batch_multiple=4)
    assert tokens.shape == (4, 32)
    assert tokens[1, 31] == vocabulary.eos_id and np.all(tokens[1, :31] != 0)
    full = len(list(vocabulary.encode(long)))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"[moe-jax infer] warning: input 2 ({long[:30]!r}...) has {full} tokens; only its "
        "first 31 are read (infer.task_feature_lengths['inputs'] = 32, one for EOS)"
    ]
