"""Feature drafts (EAGLE-style): the target's features through the family contract and the
chain loop, and `FeatureDraft` decoding exactly.

The features a draft receives are checked against the target's own uncached
forward pass over the final output: at every position they are a function of
the accepted tokens only.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.decoder_only.model import feature_layers
from specdec_jax.families.decoder_only.network import DecoderOnly
from specdec_jax.families.registry import family_of


def _target(vocab=64, seed=0, dtype="float32"):
  return sj.load_model("llama_tiny", vocab_size=vocab, seed=seed, dtype=dtype)


def _uncached_features(model, tokens, layers=None):
  """Features [batch, T, f] of tokens at positions 0..T-1 (no cache)."""
  taps = feature_layers(model.config, layers)

  def run(params, tokens):
    module = DecoderOnly(model.config)
    return module.apply({"params": params}, tokens, jnp.arange(tokens.shape[1])[None],
                        taps=taps, method=DecoderOnly._hidden)[2]

  return np.asarray(jax.jit(run)(model.params, jnp.asarray(tokens)))


# ---------------------------------------------------------------------------
# 1. The family capability.

@pytest.mark.parametrize("layers", [None, (0, 1, 2), "eagle3"])
def test_feature_block_matches_block_and_uncached_forward(layers):
  model = _target()
  if layers == "eagle3":
    model = sj.load_model("llama_tiny", vocab_size=64, seed=0, dtype="float32", num_layers=6)
  family = family_of(model)
  cfg = model.config
  taps = feature_layers(cfg, layers)
  assert taps == {None: (cfg.num_layers,), "eagle3": (2, 3, 3)}.get(layers, taps)
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, 64, (2, 9)).astype(np.int32)
  lengths = jnp.array([6, 6], jnp.int32)
  start, prompt_features = family.start_features(cfg, model.params, jnp.asarray(tokens[:, :6]),
                                                 lengths, 4, layers)
  assert prompt_features.shape == (2, 6, family.feature_dim(cfg, layers))
  block = jnp.asarray(tokens[:, 5:9])
  positions = jnp.array([5, 5], jnp.int32)
  logits, features, _ = family.feature_block_fn(cfg, model.params, layers)(
      block, positions, start.cache)
  want_logits, _ = family.block_fn(cfg, model.params)(block, positions, start.cache)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(want_logits))
  want = _uncached_features(model, tokens, layers)
  np.testing.assert_allclose(np.asarray(features), want[:, 5:9], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(prompt_features), want[:, :6], rtol=1e-5, atol=1e-5)
  if layers is None:  # After the final norm: the logits are its projection.
    head = DecoderOnly(cfg).apply({"params": model.params}, features,
                                  method=DecoderOnly.project_logits)
    np.testing.assert_allclose(np.asarray(head), np.asarray(logits), rtol=1e-5, atol=1e-5)


def test_bad_feature_layers_are_named():
  cfg = _target().config
  for bad in ((), (cfg.num_layers + 1,), "middle"):
    with pytest.raises(ValueError, match="feature layers"):
      feature_layers(cfg, bad)
  with pytest.raises(ValueError, match="does not expose its hidden states"):
    family_of(sj.load_model("tiny", vocab_size=32)).feature_dim(None)
