"""The project's export format, other libraries' checkpoints, and notebooks.

export_format  the export (safetensors under T5X-like names, ``config.json``): names and
               layouts, reading and checks, where an export or an import may write
hf             Hugging Face T5 / mT5 / Switch Transformers folders: tensor names, shapes and
               configs mapped onto the export format and ``T5Config``
notebook       ``moe_jax.load(RUN_DIR)``: a run's model and parameters, ``forward(inputs,
               targets)`` giving logits and expert choices
"""
