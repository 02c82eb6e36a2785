"""Feature drafts as tree proposers: `TreeDraft(FeatureDraft(target))` and
`DynamicTreeDraft(FeatureDraft(target))`, both families.

The loop hands the head the target's features along the accepted path
(`TreeProposer.observe`); the head grows the tree with tree attention over its
own cache. Exactness as for every tree: greedy outputs equal target-only
decoding at the same block width bit for bit (f32 and bf16), sampled outputs
follow the target's law (chi-square against the exact enumeration).
"""

import collections

import jax
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.registry import family_of

import test_feature_draft as decoder_only_features
import test_t5_feature_draft as t5_features

pytestmark = pytest.mark.slow


def _trees(random_head, copy_head, dtype):
  """A static and a dynamic tree of the copy head (accepted often); in float32 also the
  random head in another static shape (each tree is a compile of its own: few of them)."""
  trees = [sj.TreeDraft(copy_head, (2, 2, 1)),
           sj.DynamicTreeDraft(copy_head, topk=2, depth=3, node_budget=7)]
  if dtype == "float32":
    trees.append(sj.TreeDraft(random_head, (3, 1), children="iid"))
  return trees


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_feature_trees_equal_target_only_decoder_only(dtype):
  target = decoder_only_features._cast(decoder_only_features._target(vocab=16, seed=1), dtype)
  tokens, lengths = decoder_only_features._prompts(5, 7, 16, seed=3)
  kwargs = dict(max_decode_steps=20, block_width=12, eos_id=-1)
  want = sj.generate(target, tokens, lengths, **kwargs)
  accepted = 0
  for draft in _trees(sj.FeatureDraft(target, seed=2), decoder_only_features._copy_head(target),
                      dtype):
    got = sj.generate(target, tokens, lengths, draft=draft, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
    accepted += int(got.stats.accepted.sum())
  assert accepted > 0  # the copy head's trees are accepted


def test_greedy_feature_tree_on_a_learned_position_gpt2_target():
  target = sj.load_model("gpt2_tiny", vocab_size=16, seed=4, dtype="float32")
  tokens, lengths = decoder_only_features._prompts(4, 6, 16, seed=5)
  kwargs = dict(max_decode_steps=16, block_width=8, eos_id=-1)
  want = sj.generate(target, tokens, lengths, **kwargs)
  got = sj.generate(target, tokens, lengths, draft=sj.TreeDraft(sj.FeatureDraft(target), (2, 2)),
                    **kwargs)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_feature_trees_equal_target_only_t5(dtype):
  target = t5_features._cast(t5_features._target(vocab=16, seed=1), dtype)
  enc = t5_features._encoder_rows(4, 7, 16, seed=3)
  kwargs = dict(max_decode_steps=16, block_width=12, eos_id=-1)
  want = sj.generate(target, enc, **kwargs)
  accepted = 0
  for draft in _trees(sj.FeatureDraft(target, seed=2), t5_features._copy_head(target), dtype):
    got = sj.generate(target, enc, draft=draft, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
    accepted += int(got.stats.accepted.sum())
  assert accepted > 0


def _sampled(target, inputs, expected, draft, n, seed, setting):
  from test_speculative import P_VALUE, _chi_square_ok
  out = sj.generate(target, np.repeat(inputs[None], n, axis=0), max_decode_steps=3,
                    draft=draft, block_width=draft.num_nodes, rng=jax.random.PRNGKey(seed),
                    **setting)
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert len(observed) > 10
  assert _chi_square_ok(observed, expected, n) > P_VALUE


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7, topk=3)],
                         ids=["t1", "t0.7_top3"])
def test_sampled_feature_trees_follow_target_distribution_decoder_only(setting):
  """Whole 3-token decodes over a vocabulary of 8, 10,000 samples each, a tree drawn
  without replacement and a dynamic (top-k, point-mass) tree, against the exact
  enumeration (chi-square at P_VALUE = 1e-4, as in test_trees.py)."""
  import test_trees
  target = sj.load_model("llama_tiny", vocab_size=8, seed=21, dtype="float32")
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, 3, eos, **setting)
  head = sj.FeatureDraft(target, seed=5)
  _sampled(target, prompt, expected, sj.TreeDraft(head, (2, 1)), 10_000, 23, setting)
  _sampled(target, prompt, expected, sj.DynamicTreeDraft(head, topk=2, depth=2, node_budget=4),
           10_000, 24, setting)


def test_sampled_feature_tree_follows_target_distribution_t5():
  from test_speculative import _exact_sequence_distribution
  setting = dict(temperature=1.0, topp=0.8)
  target = t5_features._target(vocab=8, seed=11)
  enc_row = np.array([5, 3, 7, 2], np.int32)
  expected = _exact_sequence_distribution(target, enc_row, 3, eos_id=1, **setting)
  _sampled(target, enc_row, expected, sj.TreeDraft(t5_features._copy_head(target), (2, 1)),
           10_000, 29, setting)


def test_greedy_eagle3_tree_equals_target_only():
  """An EAGLE-3 head (reduced vocabulary, its own lm_head) grows the tree."""
  target = sj.load_model("llama_tiny", vocab_size=32, seed=6, dtype="float32", num_layers=7)
  draft_ids = np.sort(np.random.default_rng(0).choice(32, 12, replace=False))
  head = sj.FeatureDraft(target, head=sj.Eagle3Head(target.config, draft_to_target=draft_ids))
  tokens, lengths = decoder_only_features._prompts(3, 6, 32, seed=7)
  kwargs = dict(max_decode_steps=12, block_width=8, eos_id=-1)
  want = sj.generate(target, tokens, lengths, **kwargs)
  got = sj.generate(target, tokens, lengths, draft=sj.TreeDraft(head, (2, 2)), **kwargs)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
