"""Other libraries' checkpoints and notebooks.

hf        Hugging Face T5 / mT5 / Switch Transformers folders: tensor names, shapes and
          configs mapped onto this project's export format and ``T5Config``
notebook  ``moe_jax.load(RUN_DIR)``: a run's model and parameters, ``forward(inputs,
          targets)`` giving logits and expert choices
"""
