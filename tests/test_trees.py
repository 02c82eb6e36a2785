"""Token trees through the whole engine: exact in law, identical in greedy, for both families.

Greedy identity is by construction (core/tree_decoding.py): a tree at block
width W gives the target-only program's tokens at width W, in float32 and
bfloat16, including random near-tie pairs, where any token decided by logits
of a non-first branch (keys at other cache indices, other rounding) would
eventually differ.

Statistical tests: chi-square at a false-alarm rate of 1e-4 per test (as in
test_speculative.py), 10,000 samples of 3-token decodes over an 8-token
vocabulary against the exact enumeration of the target's law. Power: a tree
rule that forgets to renormalise the residual, or draws siblings without
replacement but verifies them as i.i.d., moves the law of the first two
tokens by a chi-square effect of >= 0.05 on these models (measured by
decoding with the broken rule), where power 0.99 at the 1e-4 level needs an
effect of about 0.018 at 10,000 samples (test_speculative.py's docstring).
"""

import collections

import jax
import numpy as np
import pytest
from test_block_width import _near_tie_pair
from test_speculative import P_VALUE, _chi_square_ok, _exact_sequence_distribution

import specdec_jax as sj
from specdec_jax.core import sampling
from specdec_jax.families.registry import family_of
from specdec_jax.perturbation import perturbed_model
from specdec_jax.tools import testing

# `make test-slow` (CI runs it beside `make test`): the long statistical and method suites.
pytestmark = pytest.mark.slow


def _cast(model, dtype):
  return family_of(model).model_type(
      model.config.replace(dtype=dtype),
      jax.tree_util.tree_map(lambda x: x.astype(dtype), model.params))


def _lm_pair(vocab=64, noise=0.12, seed=0, name="llama_tiny"):
  return testing.tiny_pair(vocab_size=vocab, noise=noise, seed=seed, name=name)


def _prompts(batch, length, vocab, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, (batch, length)).astype(np.int32)
  lengths = rng.integers(1, length + 1, batch).astype(np.int32)
  lengths[0] = length
  return tokens, lengths


# ---------------------------------------------------------------------------
# Greedy: bit for bit the target's own output at the same width.

# bfloat16: the demo pairs and the near-tie pair below (the same code path).
@pytest.mark.parametrize("dtype", ["float32"])
@pytest.mark.parametrize("family", ["t5", "decoder_only"])
def test_greedy_tree_equals_target_only_at_the_same_width(family, dtype):
  if family == "t5":
    target, draft = testing.tiny_pair(vocab_size=64, noise=0.12, seed=0)
    inputs, lengths = testing.random_encoder_tokens(6, 10, 64, seed=2), None
  else:
    target, draft = _lm_pair()
    inputs, lengths = _prompts(6, 7, 64, seed=3)
  target, draft = _cast(target, dtype), _cast(draft, dtype)
  steps, width = 20, 12
  expected = sj.generate(target, inputs, lengths, max_decode_steps=steps, block_width=width)
  for branching, children in (((2, 2, 1), "without_replacement"), ((3, 1, 1), "iid")):
    tree = sj.TreeDraft(draft, branching, children=children)
    out = sj.generate(target, inputs, lengths, max_decode_steps=steps, draft=tree,
                      block_width=width)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(expected.sequences),
                                  err_msg=f"{branching}")
    s = out.stats
    np.testing.assert_array_equal(s.emitted, np.asarray(expected.lengths))
    np.testing.assert_array_equal(s.depth_histogram.sum(1), s.iterations)
    assert (s.rank_accepted <= s.rank_tried).all()
    assert s.mean_tokens_per_iteration > 1.2, s.summary()
    # A tree beats its own first path: some accepted child is not the first.
    assert s.rank_accepted[:, 1:].sum() > 0, s.summary()


@pytest.mark.parametrize("family", ["t5", "decoder_only"])
def test_greedy_tree_identity_on_a_random_near_tie_pair_bf16(family):
  # Random weights give flat next-token distributions: many near-ties (the
  # pairs of test_block_width.py, where a 1-token and a (gamma + 1)-token
  # block disagree on some rows). Accepted non-first branches are emitted
  # only after their first-path re-verification, so no row may differ.
  target, draft, inputs, lengths = _near_tie_pair(family, "bfloat16")
  steps, width = 32, 16
  expected = sj.generate(target, inputs, lengths, max_decode_steps=steps, eos_id=-1,
                         block_width=width)
  trees = [sj.TreeDraft(draft, (3, 2, 1))]
  if family == "t5":
    trees.append(sj.DynamicTreeDraft(draft, topk=3, depth=4, node_budget=16))
  for tree in trees:
    out = sj.generate(target, inputs, lengths, max_decode_steps=steps, eos_id=-1,
                      block_width=width, draft=tree)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(expected.sequences),
                                  err_msg=type(tree).__name__)
    assert out.stats.rank_accepted[:, 1:].sum() > 0, out.stats.summary()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["t5", "decoder_only"])
def test_demo_pair_greedy_tree_equals_target_only(name, dtype):
  try:
    pair = sj.load_demo_pair(name, dtype=dtype)
  except FileNotFoundError as e:
    pytest.skip(str(e))
  inputs, lengths = pair.inputs(4)
  steps, width = min(pair.max_decode_steps, 32), 16
  draft = next(iter(pair.drafts.values()))
  expected = sj.generate(pair.target, inputs, lengths, max_decode_steps=steps, block_width=width)
  out = sj.generate(pair.target, inputs, lengths, max_decode_steps=steps, block_width=width,
                    draft=sj.TreeDraft(draft, (3, 2, 1)))
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(expected.sequences))
  assert out.stats.mean_tokens_per_iteration > 1.5, out.stats.summary()


def test_greedy_ngram_tree_equals_target_only():
  target, _ = _lm_pair(vocab=48, seed=5)
  prompts, lengths = _prompts(4, 6, 48, seed=6)
  plain = sj.generate(target, prompts, lengths, max_decode_steps=24, block_width=10)
  ngram = sj.NgramDraft.fit(np.asarray(plain.sequences), 48, order=2, smoothing=0.1,
                            eos_id=target.config.eos_id, pad_id=target.config.pad_id)
  out = sj.generate(target, prompts, lengths, max_decode_steps=24, block_width=10,
                    draft=sj.TreeDraft(ngram, (3, 2)))
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(plain.sequences))
  assert out.stats.mean_tokens_per_iteration > 1.0


@pytest.mark.parametrize("family", ["t5", "decoder_only"])
def test_sampling_path_moves_accepted_branches_into_the_cache(family):
  """top-k 1 sampling is deterministic but runs the sampling path: every
  accepted path, first branch or not, is emitted at once and its keys and
  values moved into place. A wrong move would corrupt every later logit."""
  if family == "t5":
    target, draft = testing.tiny_pair(vocab_size=64, noise=0.3, seed=7)
    inputs, lengths = testing.random_encoder_tokens(6, 9, 64, seed=8), None
  else:
    target, draft = _lm_pair(noise=0.3, seed=7)
    inputs, lengths = _prompts(6, 7, 64, seed=8)
  greedy = sj.generate(target, inputs, lengths, max_decode_steps=20, block_width=16)
  out = sj.generate(target, inputs, lengths, max_decode_steps=20, block_width=16,
                    temperature=1.0, topk=1, draft=sj.TreeDraft(draft, (3, 2, 1), children="topk"))
  # Float32 logits of other branches equal the chain's to rounding: the argmax
  # of these random models is never that close.
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(greedy.sequences))
  assert out.stats.rank_accepted[:, 1:].sum() > 0, out.stats.summary()


# ---------------------------------------------------------------------------
# Sampling: the target's law, whole decodes.

def _t5_law_case(setting):
  vocab, steps = 8, 3
  target = sj.load_model("tiny", vocab_size=vocab, seed=11, dtype="float32")
  draft = perturbed_model(target, 0.5, seed=13)
  enc_row = np.array([5, 3, 7, 2], np.int32)
  expected = _exact_sequence_distribution(target, enc_row, steps, eos_id=1, **setting)
  return target, draft, enc_row, expected, steps


@pytest.mark.parametrize("setting,children", [
    (dict(temperature=1.0), "iid"),
    (dict(temperature=0.7, topk=3), "without_replacement"),
    (dict(temperature=1.0, topp=0.8), "dynamic"),
], ids=["t1_iid", "top3_worep", "topp0.8_dynamic"])
def test_tree_samples_follow_target_distribution(setting, children):
  n = 10_000
  target, draft, enc_row, expected, steps = _t5_law_case(setting)
  # The dynamic tree's children are top-k point masses pruned by cumulative
  # draft probability: the 'topk' law, and a choice made from the draft alone.
  tree = (sj.DynamicTreeDraft(draft, topk=2, depth=2, node_budget=5) if children == "dynamic"
          else sj.TreeDraft(draft, (3, 2), children=children))
  out = sj.generate(target, np.repeat(enc_row[None], n, axis=0), max_decode_steps=steps,
                    draft=tree, block_width=10, rng=jax.random.PRNGKey(17), **setting)
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert len(observed) > 10
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  assert _chi_square_ok(observed, expected, n) > P_VALUE


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.8, topk=3),
                                     dict(temperature=1.0, topp=0.8)],
                         ids=["t1", "t0.8_top3", "topp0.8"])
def test_ngram_tree_samples_follow_target_distribution(setting):
  n = 10_000
  target, _, enc_row, expected, steps = _t5_law_case(setting)
  corpus = np.random.default_rng(0).integers(2, 8, (50, 6))
  ngram = sj.NgramDraft.fit(corpus, 8, order=2, smoothing=0.5)
  out = sj.generate(target, np.repeat(enc_row[None], n, axis=0), max_decode_steps=steps,
                    draft=sj.TreeDraft(ngram, (2, 2)), block_width=7,
                    rng=jax.random.PRNGKey(19), **setting)
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


def _exact_lm_distribution(model, prompt, steps, eos_id, **setting):
  """P(continuation) of a decoder-only model by enumerating every continuation."""
  import itertools
  vocab = model.config.vocab_size
  seqs = np.array(list(itertools.product(range(vocab), repeat=steps)), np.int32)
  tokens = np.concatenate([np.repeat(prompt[None], len(seqs), 0), seqs], axis=1)
  family = family_of(model)
  logits, _, _ = family.token_logits(model.config, model.params,
                                     dict(tokens=tokens, weights=np.ones_like(tokens)))
  probs = np.asarray(sampling.adjust_probs(logits[:, len(prompt) - 1:], **setting))
  chain = np.prod(np.take_along_axis(probs, seqs[..., None], axis=-1)[..., 0], axis=1)
  dist = collections.defaultdict(float)
  for seq, prob in zip(seqs.tolist(), chain):
    out = []
    for token in seq:
      out.append(0 if out and (eos_id in out) else token)
    dist[tuple(out)] += prob
  return dist


def test_decoder_only_tree_samples_follow_target_distribution():
  n, steps = 10_000, 3
  target = sj.load_model("llama_tiny", vocab_size=8, seed=21, dtype="float32")
  draft = perturbed_model(target, 0.5, seed=22)
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = _exact_lm_distribution(target, prompt, steps, eos, temperature=1.0)
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    temperature=1.0, draft=sj.TreeDraft(draft, (2, 2)), block_width=7,
                    rng=jax.random.PRNGKey(23))
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


# ---------------------------------------------------------------------------
# Bad input.

def test_bad_trees_get_clear_errors():
  target, draft = testing.tiny_pair(vocab_size=32, seed=1)
  enc = testing.random_encoder_tokens(2, 5, 32)
  with pytest.raises(ValueError, match="branching is empty"):
    sj.TreeDraft(draft, ())
  with pytest.raises(ValueError, match=r"branching\[1\] = 0"):
    sj.TreeDraft(draft, (2, 0))
  with pytest.raises(ValueError, match="children must be one of"):
    sj.TreeDraft(draft, (2,), children="best")
  with pytest.raises(TypeError, match="no distribution at every tree node"):
    sj.TreeDraft(sj.PromptLookupDraft(32), (2,))
  with pytest.raises(ValueError, match="verifies a chain"):
    sj.generate(target, enc, max_decode_steps=4, draft=sj.TreeDraft(draft, (2,)),
                verification="block", block_width=8)
  for bad in (dict(topk=0), dict(depth=1.5), dict(node_budget=1)):
    with pytest.raises(ValueError):
      sj.DynamicTreeDraft(draft, **bad)
  # A budget above what topk and depth grow (2 + 2 * 4 = 10 candidates) holds them all
  # (it crashed inside the program); it decodes as target-only does, greedy.
  small = sj.DynamicTreeDraft(draft, topk=2, depth=3)
  assert small.num_nodes == 11 and sj.DynamicTreeDraft(draft, topk=4, depth=4).num_nodes == 16
  np.testing.assert_array_equal(
      np.asarray(sj.generate(target, enc, max_decode_steps=6, draft=small,
                             block_width=11).sequences),
      np.asarray(sj.generate(target, enc, max_decode_steps=6, block_width=11).sequences))
  with pytest.raises(ValueError, match="pass block_width=11"):
    sj.generate(target, enc, max_decode_steps=4, draft=sj.TreeDraft(draft, (2, 2, 1)),
                block_width=8)
