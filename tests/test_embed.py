"""Function-preserving embedding (specdec_jax/families/t5/embed.py): a larger shape, the same function."""

import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.t5 import embed
from specdec_jax.tools import testing
from specdec_jax.demo_pair import load_demo_pair


def _teacher_forced(model, enc, targets):
  dec = np.concatenate([np.zeros((len(targets), 1), np.int32), targets[:, :-1]], axis=1)
  return np.asarray(model.logits(enc, dec))

@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow

def test_demo_target_embedded_at_t5_1_1_base_shape():
  """The shipped (trained) demo target in the T5 1.1 base shape: gated, untied, 12+12 layers."""
  pair = load_demo_pair()
  small = pair.target
  large = embed.embed_model(small, "t5_1_1_base")
  base = sj.get_config("t5_1_1_base")
  cfg = large.config
  assert (cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.num_encoder_layers,
          cfg.num_decoder_layers, cfg.mlp_activations, cfg.logits_via_embedding) == (
              base.emb_dim, base.num_heads, base.head_dim, base.mlp_dim, base.num_encoder_layers,
              base.num_decoder_layers, base.mlp_activations, base.logits_via_embedding)
  assert cfg.vocab_size == small.config.vocab_size and cfg.dtype == "float32"
  assert cfg.num_params > 10 * small.config.num_params

  enc = pair.heldout_inputs(2)
  targets = np.stack([np.pad(r["target_ids"][:12], (0, max(0, 12 - len(r["target_ids"]))))
                      for r in pair.heldout[:2]]).astype(np.int32)
  want = _teacher_forced(small, enc, targets)
  got = _teacher_forced(large, enc, targets)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

  steps = 12
  want = sj.generate(small, enc, max_decode_steps=steps).sequences
  got = sj.generate(large, enc, max_decode_steps=steps).sequences
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow

def test_every_growth_at_once_keeps_logits_and_greedy_outputs():
  """Width x3, more heads, wider heads, more MLP units, more encoder and decoder layers."""
  small = sj.load_model("tiny", vocab_size=97, seed=3, dtype="float32")
  shape = small.config.replace(emb_dim=192, num_heads=6, head_dim=24, mlp_dim=200,
                               num_encoder_layers=3, num_decoder_layers=4)
  large = embed.embed_model(small, shape)
  assert large.params["decoder"]["layers_3"]["mlp"]["wo"]["kernel"].shape == (200, 192)
  enc = testing.random_encoder_tokens(3, 9, 97, seed=1)
  targets = np.asarray(testing.random_encoder_tokens(3, 7, 97, seed=2, min_length=7))
  want = _teacher_forced(small, enc, targets)
  np.testing.assert_allclose(_teacher_forced(large, enc, targets), want, rtol=1e-4,
                             atol=1e-4 * np.abs(want).max())
  np.testing.assert_array_equal(
      np.asarray(sj.generate(large, enc, max_decode_steps=10).sequences),
      np.asarray(sj.generate(small, enc, max_decode_steps=10).sequences))


def test_layouts_that_cannot_be_preserved_are_named():
  small = sj.get_config("tiny", vocab_size=97)
  cases = {
      "logits_via_embedding": small.replace(logits_via_embedding=True, mlp_activations=("relu",)),
  }
  with pytest.raises(embed.EmbeddingError, match="tied logits"):
    embed.check_embeddable(cases["logits_via_embedding"],
                           cases["logits_via_embedding"].replace(emb_dim=128))
  with pytest.raises(embed.EmbeddingError, match="relative_attention_num_buckets"):
    embed.check_embeddable(small, small.replace(relative_attention_num_buckets=64))
  with pytest.raises(embed.EmbeddingError, match="relative_attention_num_buckets"):
    embed.embedded_config(small.replace(relative_attention_num_buckets=16), "t5_1_1_base")
  with pytest.raises(embed.EmbeddingError, match="not a multiple"):
    embed.check_embeddable(small, small.replace(emb_dim=100))
  with pytest.raises(embed.EmbeddingError, match="num_decoder_layers shrinks"):
    embed.check_embeddable(small, small.replace(num_decoder_layers=1))
  with pytest.raises(embed.EmbeddingError, match="vocab_size differs"):
    embed.check_embeddable(small, small.replace(vocab_size=128))
  with pytest.raises(embed.EmbeddingError, match="mlp_activations differs"):
    embed.check_embeddable(small, small.replace(mlp_activations=("relu",)))
  with pytest.raises(embed.EmbeddingError, match="unknown shape"):
    embed.embedded_config(small, "t5_1_1_huge")


def test_named_shape_takes_the_small_models_vocabulary():
  small = sj.get_config("tiny", vocab_size=97, dtype="float32")
  large = embed.embedded_config(small, "t5_1_1_xxl", dtype="bfloat16")
  xxl = sj.get_config("t5_1_1_xxl")
  assert (large.emb_dim, large.num_heads, large.mlp_dim, large.num_decoder_layers) == (
      xxl.emb_dim, xxl.num_heads, xxl.mlp_dim, xxl.num_decoder_layers)
  assert large.vocab_size == 97 and large.dtype == "bfloat16"

@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow

def test_embedded_feature_head_drafts_what_the_small_head_drafts():
  """A T5 feature head grown with its target (`embed_feature_head_params`): the large pair
  drafts and accepts exactly what the small pair does (greedy, float32)."""
  small = sj.load_model("tiny", vocab_size=97, seed=3, dtype="float32")
  shape = small.config.replace(emb_dim=192, num_heads=6, head_dim=24, mlp_dim=200,
                               num_encoder_layers=3, num_decoder_layers=4)
  large = embed.embed_model(small, shape)
  head = sj.FeatureDraft(small, seed=4)
  large_head = sj.FeatureDraft(large, head_params=embed.embed_feature_head_params(
      head.head_params, small.config, large.config))
  enc = testing.random_encoder_tokens(3, 9, 97, seed=1)
  want = sj.generate(small, enc, max_decode_steps=12, draft=head, gamma=3)
  got = sj.generate(large, enc, max_decode_steps=12, draft=large_head, gamma=3)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  np.testing.assert_array_equal(np.asarray(got.stats.accepted), np.asarray(want.stats.accepted))
  assert int(want.stats.iterations.sum()) > 0
