"""Tiny random models of both families, in any dtype, for the draft and engine tests."""

import jax

import specdec_jax as sj
from specdec_jax.families.registry import family_of

NAMES = {"t5": "tiny", "decoder_only": "llama_tiny"}


def tiny_model(family: str, vocab: int = 16, seed: int = 3, dtype: str = "float32"):
  """The family's tiny named config with `vocab` ids (small enough for near-ties), random
  weights of `seed`, cast to `dtype` after a float32 init (so dtypes share the function)."""
  model = sj.load_model(NAMES[family], vocab_size=vocab, seed=seed, dtype="float32")
  if dtype != "float32":
    model = family_of(model).model_type(
        model.config.replace(dtype=dtype),
        jax.tree_util.tree_map(lambda x: x.astype(dtype), model.params))
  return model
