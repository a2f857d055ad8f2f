"""Our attention inside the models people run, with no adapter code.

- [`attention_multi.integrations.transformers`][]: ``register()`` makes this
  library an ``attn_implementation`` of Hugging Face transformers (torch).
- [`attention_multi.integrations.flax`][]: ``dot_product_attention`` is an
  ``attention_fn`` of flax's ``nnx.MultiHeadAttention`` (JAX).

Each imports its framework when it is imported itself: ``import
attention_multi`` imports neither transformers nor flax.
"""
