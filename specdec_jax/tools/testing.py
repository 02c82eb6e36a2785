"""Helpers for tests and examples: random pairs of models, random inputs, rows that split
at an EOS id.

The pairs disagree a little (`perturbation.perturbed_model`): a draft whose
weights are the target's plus noise has an acceptance rate strictly inside
(0, 1).
"""

import jax
import jax.numpy as jnp

from specdec_jax.loading import load_model
from specdec_jax.perturbation import perturbed_model


def tiny_pair(vocab_size: int = 64, noise: float = 0.3, seed: int = 0, name: str = "tiny",
              **overrides):
  """(target, draft): a random target of the named config `name` (any family's, e.g.
  'tiny' for T5, 'llama_tiny'), float32, and its noisy copy."""
  target = load_model(name, vocab_size=vocab_size, seed=seed, dtype="float32", **overrides)
  return target, perturbed_model(target, noise, seed + 1)


def random_encoder_tokens(batch: int, length: int, vocab_size: int, seed: int = 0,
                          min_length: int = 1):
  """[batch, length] int32 in [2, vocab) with rows 0-padded to random lengths."""
  rng = jax.random.PRNGKey(seed)
  tok_rng, len_rng = jax.random.split(rng)
  tokens = jax.random.randint(tok_rng, (batch, length), 2, vocab_size, jnp.int32)
  lengths = jax.random.randint(len_rng, (batch,), min_length, length + 1)
  lengths = lengths.at[0].set(length)
  return jnp.where(jnp.arange(length)[None] < lengths[:, None], tokens, 0)


def eos_splitting_rows(sequences, first_id: int = 2) -> int:
  """A token id that appears in some rows of `sequences` [batch, len] but not all.

  Greedy decisions do not depend on the EOS id, so decoding again with this id
  as EOS gives a batch in which some rows stop early and others run to the
  length limit: the case where rows must advance independently.
  """
  import numpy as np
  seqs = np.asarray(sequences)
  counts = np.bincount(seqs.ravel(), minlength=first_id + 1)
  for token in np.argsort(-counts, kind="stable"):
    rows_with = int((seqs == token).any(axis=1).sum())
    if token >= first_id and 0 < rows_with < len(seqs):
      return int(token)
  raise ValueError("no token splits the rows; use more rows or longer outputs")
