"""The target drafting for itself from a budgeted view of its cache (`sj.SparseCacheDraft`).

Exactness is the verification rule's (any q), so the tests check what could break it: the
draft reading positions the target has not accepted, the proposer's laws not being the
tokens' laws. Greedy outputs equal target-only token for token (chains, block
verification, `generate_many`, float32 and bfloat16); sampled whole decodes follow the
target's enumerated law (chi-square, power asserted).
"""

import collections

import jax
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.registry import family_of

POLICIES = {"window": dict(policy="window", budget=16, sinks=2),
            "retrieval": dict(policy="retrieval", budget=32, chunk=8)}


def _target(dtype="float32", name="llama_tiny", vocab=64, seed=3):
  model = sj.load_model(name, vocab_size=vocab, seed=seed, dtype="float32")
  config = model.config.replace(attention_chunk=16, dtype=dtype)
  return family_of(model).model_type(
      config, jax.tree_util.tree_map(lambda x: x.astype(dtype), model.params))


def _inputs():
  prompts = np.random.RandomState(0).randint(3, 64, size=(3, 60)).astype(np.int32)
  return prompts, np.array([60, 41, 52], np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_outputs_equal_target_only(policy, dtype):
  target = _target(dtype)
  prompts, lengths = _inputs()
  kw = dict(max_decode_steps=24, eos_id=-1, block_width=5)
  expected = np.asarray(sj.generate(target, prompts, lengths, **kw).sequences)
  draft = sj.SparseCacheDraft(target, **POLICIES[policy])
  out = sj.generate(target, prompts, lengths, draft=draft, gamma=4, **kw)
  np.testing.assert_array_equal(np.asarray(out.sequences), expected, err_msg="chain")
  assert 0.0 < out.stats.acceptance_rate < 1.0, out.stats.summary()
  block = sj.generate(target, prompts, lengths, draft=draft, gamma=4, verification="block", **kw)
  np.testing.assert_array_equal(np.asarray(block.sequences), expected, err_msg="block")
  if dtype == "float32":
    many = sj.generate_many(target, prompts, lengths, batch_size=2, draft=draft, gamma=4, **kw)
    np.testing.assert_array_equal(np.asarray(many.sequences), expected, err_msg="generate_many")


def test_a_budget_that_holds_the_context_drafts_as_the_target():
  """Every written position fits the budget: the draft is the target on the same
  positions (greedy α 1, up to rounding)."""
  target = _target()
  prompts, lengths = _inputs()
  draft = sj.SparseCacheDraft(target, budget=80, policy="window")
  out = sj.generate(target, prompts, lengths, draft=draft, gamma=4, max_decode_steps=24,
                    eos_id=-1, block_width=5)
  assert out.stats.acceptance_rate > 0.95, out.stats.summary()


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=1.0, topk=5),
                                     dict(temperature=1.0, topp=0.8)],
                         ids=["t1", "topk5", "topp0.8"])
@pytest.mark.parametrize("policy", ["window", "retrieval"])
def test_samples_follow_the_target_distribution(policy, setting):
  """Whole 3-token decodes over a vocabulary of 8 after a 24-token prompt (longer than
  the budget, so the draft's law differs from the target's), 10,000 samples, against the
  exact enumeration of the target's law (chi-square at p 1e-4); the smallest chi-square
  effect detected with power 0.99 is computed for these cells (`test_medusa._power`) and
  asserted below 0.025."""
  import test_trees
  from test_medusa import _power
  from test_speculative import P_VALUE, _chi_square_ok
  n, steps = 10_000, 3
  target = sj.load_model("llama_tiny", vocab_size=8, seed=21, dtype="float32")
  target = family_of(target).model_type(target.config, jax.tree_util.tree_map(
      lambda x: x * 3, target.params))  # sharper laws: acceptance away from 1
  prompt = np.random.RandomState(2).randint(3, 8, size=24).astype(np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, steps, eos, **setting)
  df, effect = _power(expected, n)
  assert effect < 0.025, (df, effect)
  options = (dict(policy="window", budget=6, sinks=1) if policy == "window" else
             dict(policy="retrieval", budget=8, chunk=2))
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    draft=sj.SparseCacheDraft(target, **options), gamma=2, block_width=3,
                    rng=jax.random.PRNGKey(23), **setting)
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


def test_bad_input_gets_clear_errors():
  target = _target()
  prompts, lengths = _inputs()
  with pytest.raises(ValueError, match="policy must be one of"):
    sj.SparseCacheDraft(target, policy="random")
  with pytest.raises(ValueError, match="budget=16 must be >= 2 \\* chunk = 32"):
    sj.SparseCacheDraft(target, budget=16, policy="retrieval", chunk=16)
  with pytest.raises(ValueError, match="leaves no recent positions"):
    sj.SparseCacheDraft(target, budget=4, sinks=4)
  # A budget larger than the context: refused before any work, naming the fix.
  with pytest.raises(ValueError, match="covers the whole cache this decode allocates"):
    sj.generate(target, prompts, lengths, draft=sj.SparseCacheDraft(target, budget=200),
                max_decode_steps=8)
  # A target whose every layer reads a window no wider than the budget gains nothing.
  mixtral = sj.load_model("mixtral_tiny", vocab_size=64)
  with pytest.raises(ValueError, match="window of 8 <= budget=16"):
    sj.SparseCacheDraft(mixtral, budget=16)
  # A family that gives no view (T5, for now) says so.
  t5 = sj.load_model("tiny", vocab_size=64)
  with pytest.raises(ValueError, match="gives no budgeted view of its cache"):
    sj.SparseCacheDraft(t5)
  with pytest.raises(TypeError, match="verify it as a chain"):
    sj.generate(target, prompts, lengths, max_decode_steps=4, block_width=5,
                draft=sj.TreeDraft(sj.SparseCacheDraft(target, budget=16), (2, 1)))
