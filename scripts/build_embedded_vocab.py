"""Trains the embedded SentencePiece vocabulary on the embedded UDHR corpus.

Usage::

    python scripts/build_embedded_vocab.py [--vocab_size 8000]

Writes ``moe_jax/data/embedded/udhr_spm.model``, a unigram model with the
T5/mT5 id conventions (pad 0, eos 1, unk 2, no bos) and byte fallback, so text in scripts
absent from the corpus still round-trips. seqio adds the 100 sentinel ids on top
(``seqio.SentencePieceVocabulary(path, extra_ids=100)``); they are not part of the model.
Only the train splits are used; training is deterministic for a fixed corpus.
"""

from __future__ import annotations

import argparse
import pathlib

import sentencepiece as spm

EMBEDDED = pathlib.Path(__file__).resolve().parent.parent / "moe_jax" / "data" / "embedded"


def train(vocab_size: int, out_prefix: pathlib.Path = EMBEDDED / "udhr_spm") -> pathlib.Path:
    files = sorted(str(p) for p in (EMBEDDED / "udhr").glob("*.txt") if "-validation" not in p.name)
    if not files:
        raise FileNotFoundError(
            f"no corpus files under {EMBEDDED / 'udhr'}; run scripts/build_embedded_corpus.py first"
        )
    spm.SentencePieceTrainer.train(
        input=files,
        model_prefix=str(out_prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        byte_fallback=True,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=1 << 16,
        num_threads=1,
        minloglevel=2,
    )
    out_prefix.with_suffix(".vocab").unlink()  # human-readable piece list; not needed
    return out_prefix.with_suffix(".model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab_size", type=int, default=8000)
    print(train(parser.parse_args().vocab_size))


if __name__ == "__main__":
    main()
