"""seqio data pipeline: mC4 tasks, span corruption, vocabularies, the embedded corpus.

Modules (one job each; see docs/data.md):
  vocab            the vocabulary (embedded SentencePiece, mT5 SentencePiece, bytes)
  sources          the raw-text source (embedded UDHR corpus, TFDS c4/multilingual, text)
  readers          the seqio sources each corpus is read with (built by sources)
  preprocessors    text cleaning, token splitting, the prefix-LM objective
  span_corruption  the T5/mT5 span-corruption objective as a seqio preprocessor
  tasks            registers the seqio tasks (importing it is enough; idempotent)
  pipeline         get_dataset, the resumable TrainIterator, to_global_batch
  labels           known latent clusters of a corpus (languages): label -> its own task

No module here reads gin (``moe_jax.runtime.configured`` registers the names gin files
bind and selects the source and vocabulary the tasks read). Importing this package does not
import TensorFlow or seqio, nor do ``vocab``, ``sources`` and ``pipeline`` until data is
read.
"""
