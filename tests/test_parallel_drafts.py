"""Parallel drafters (`drafts/parallel.py`): a block of drafts and their laws from one call.

* `sj.ParallelDraft` (PARD): its laws after any history of accepted tokens equal a
  plain full forward of the drafter over [context, m, ..., m] (the cache it keeps
  between calls never leaks a mask or a rejected token into a law).
* Greedy identity against target-only decoding, chain and tree, both families, float32
  and bfloat16.
* Whole-decode chi-square at temperature 1 and at top-p, chain and tree, with the
  test's power stated, and the power shown against a broken variant that draws the
  block greedily while verifying with the sampled law (the chi-square rejects it).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.registry import family_of

from tiny_models import tiny_model




def _inputs(family, vocab, batch=4, width=6, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, (batch, width)).astype(np.int32)
  if family == "t5":
    tokens[1, 3:] = 0
    return tokens, None
  return tokens, np.array([width, 1, 4, 2][:batch], np.int32)


def test_pard_laws_equal_a_full_forward_after_any_accepted_history():
  """block_laws' q_i after a row's tokens 0..L equals the drafter's full forward over
  [tokens 0..L, m x (i - 1)] at its last slot, call after call, as rows gain 1..window
  tokens (the masks and padding a call writes are overwritten before any query reads them)."""
  vocab, mask, k, window = 24, 23, 3, 4
  drafter = tiny_model("decoder_only", vocab=vocab, seed=7)
  draft = sj.ParallelDraft(drafter, mask_token_id=mask, gamma=k)
  rng = np.random.default_rng(1)
  batch, prompt_width, total = 2, 5, 40
  prompt = rng.integers(2, mask, (batch, prompt_width)).astype(np.int32)
  prompt_lengths = np.array([5, 2], np.int32)
  story = rng.integers(2, mask, (batch, total)).astype(np.int32)  # loop positions 0..
  story[:, 0] = prompt[np.arange(batch), prompt_lengths - 1]     # loop position 0: last prompt token
  context = sj.Context(jnp.asarray(prompt), jnp.asarray(prompt_lengths), continued=True)
  state = draft.init_state(draft.params, sj.DraftStart(context, total + draft.room(window), k))
  lengths = np.zeros(batch, np.int32)
  gains = [[1, 4], [4, 1], [2, 3], [3, 2], [1, 1], [4, 4]]
  for gain in [None] + gains:
    if gain is not None:
      lengths = lengths + np.array(gain, np.int32)
    logits, ready, state = jax.jit(draft.block_laws, static_argnums=(4, 5))(
        draft.params, state, jnp.asarray(story), jnp.asarray(lengths), k, window)
    assert bool(jnp.all(ready))
    for b in range(batch):
      history = np.concatenate([prompt[b, :prompt_lengths[b] - 1], story[b, :lengths[b] + 1]])
      for i in range(k):
        full = drafter.logits(jnp.asarray(np.concatenate([history, [mask] * i]).astype(np.int32)[None]))
        np.testing.assert_allclose(np.asarray(logits[b, i]), np.asarray(full[0, -1]),
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", ["decoder_only", pytest.param("t5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_greedy_pard_chain_and_tree_equal_target_only(family, dtype):
  vocab = 16
  target = tiny_model(family, vocab=vocab, seed=3, dtype=dtype)
  drafter = tiny_model(family, vocab=vocab, seed=11, dtype=dtype)
  tokens, lengths = _inputs(family, vocab)
  draft = sj.ParallelDraft(drafter, mask_token_id=vocab - 1, gamma=3)
  kwargs = dict(max_decode_steps=14, eos_id=-1)
  for use, width, extra in ((draft, 8, dict(gamma=3)), (draft, 8, dict(gamma=2)),
                            (sj.TreeDraft(draft, (3, 2, 1)), 16, {})):
    want = sj.generate(target, tokens, lengths, block_width=width, **kwargs)
    got = sj.generate(target, tokens, lengths, draft=use, block_width=width, **kwargs, **extra)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
    assert got.stats.drafted.sum() > 0


def test_pard_drafting_with_itself_accepts_its_first_token_always():
  """A drafter equal to the target: q_1 is the target's law, so greedy accepts every
  first draft (a check that q_1 is read at the row's last real token)."""
  target = tiny_model("decoder_only", vocab=32, seed=5)
  tokens, lengths = _inputs("decoder_only", 32)
  draft = sj.ParallelDraft(target, mask_token_id=31, gamma=3)
  out = sj.generate(target, tokens, lengths, draft=draft, gamma=3, max_decode_steps=12,
                    eos_id=-1)
  accepted, drafted = out.stats.position_accepted[:, 0], out.stats.position_drafted[:, 0]
  assert drafted.sum() > 0 and np.array_equal(accepted, drafted), out.stats.summary()


def test_bad_parallel_draft_input_gets_clear_errors():
  target = tiny_model("decoder_only", vocab=16)
  with pytest.raises(ValueError, match=r"mask_token_id must be an id of the drafter's "
                                       r"vocabulary \[0, 16\).*pard_token"):
    sj.ParallelDraft(target, mask_token_id=16)
  with pytest.raises(ValueError, match="gamma must be an int >= 1"):
    sj.ParallelDraft(target, mask_token_id=3, gamma=0)
  draft = sj.ParallelDraft(target, mask_token_id=3, gamma=2)
  with pytest.raises(ValueError, match="gamma=3 asks one call of this ParallelDraft for 3 laws"):
    sj.generate(target, np.ones((1, 3), np.int32), draft=draft, gamma=3, max_decode_steps=4)
  with pytest.raises(ValueError, match="a tree of depth 3 needs"):
    sj.TreeDraft(draft, (2, 2, 2))
  t5 = tiny_model("t5", vocab=16)
  with pytest.raises(ValueError, match="a t5 draft cannot serve a decoder_only target"):
    sj.generate(target, np.ones((1, 3), np.int32), draft=sj.ParallelDraft(t5, mask_token_id=3),
                max_decode_steps=4)
  small = tiny_model("decoder_only", vocab=12)
  with pytest.raises(ValueError, match="target_vocab_size=16"):
    sj.generate(target, np.ones((1, 3), np.int32),
                draft=sj.ParallelDraft(small, mask_token_id=3), max_decode_steps=4)


# -- the output law -------------------------------------------------------------------------


class GreedyBlockDraft(sj.ParallelDraft):
  """A broken variant: drafts the block greedily but hands verification the sampled law.
  Not exact at temperature > 0: the chi-square below must reject it."""

  def proposer(self, params, plan):
    inner = super().proposer(params, plan)

    def propose(rng, state, sequences, lengths, max_drafted=None):
      tokens, probs, num, state = inner.propose(rng, state, sequences, lengths, max_drafted)
      greedy = jnp.argmax(probs, axis=-1).astype(jnp.int32)
      keep = jnp.arange(tokens.shape[1])[None] < num[:, None]
      return jnp.where(keep, greedy, 0), probs, num, state

    return inner._replace(propose=propose)


def _law_case():
  target = sj.load_model("llama_tiny", vocab_size=8, seed=21, dtype="float32")
  drafter = sj.load_model("llama_tiny", vocab_size=8, seed=4, dtype="float32")
  # Sharper drafter logits, so acceptance sits away from 0 and 1.
  drafter = family_of(drafter).model_type(drafter.config, jax.tree_util.tree_map(
      lambda x: x * 3 if x.ndim == 2 and x.shape[0] == 8 else x, drafter.params))
  return target, drafter


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=1.0, topp=0.8),
                                     dict(temperature=1.0, topk=3)],
                         ids=["t1", "topp0.8", "topk3"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_pard_samples_follow_target_distribution(setting, tree):
  """Whole 3-token decodes over a vocabulary of 8 after a 3-token prompt, 10,000 samples,
  against the exact enumeration of the target's law (chi-square at p 1e-4). Power: the
  test computes, for its own cells, the smallest chi-square effect sum((p' - p)^2 / p)
  caught with probability 0.99 and asserts it is below 0.025 (e.g. one continuation of
  probability 0.1 off by 0.05)."""
  import test_trees
  from test_medusa import _power
  from test_speculative import P_VALUE, _chi_square_ok
  n, steps = 10_000, 3
  target, drafter = _law_case()
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, steps, eos, **setting)
  df, effect = _power(expected, n)
  assert effect < 0.025, (df, effect)
  draft = sj.ParallelDraft(drafter, mask_token_id=7, gamma=2)
  use, extra = (sj.TreeDraft(draft, (2, 1)), dict(block_width=5)) if tree else (
      draft, dict(gamma=2, block_width=3))
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    draft=use, rng=jax.random.PRNGKey(23), **extra, **setting)
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


@pytest.mark.slow
def test_chi_square_rejects_a_block_drawn_greedily_but_verified_with_the_sampled_law():
  """The power check made concrete: the same test, on the broken variant, fails. (The
  drafter is the target itself, so q_1 = p: drawing x_1 greedily then always emits the
  target's argmax, which the chi-square must see.)"""
  import test_trees
  from test_speculative import P_VALUE, _chi_square_ok
  n, steps = 10_000, 3
  target, _ = _law_case()
  drafter = target
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, steps, eos, temperature=1.0)
  broken = GreedyBlockDraft(drafter, mask_token_id=7, gamma=2)
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    draft=broken, gamma=2, block_width=3, rng=jax.random.PRNGKey(23),
                    temperature=1.0)
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) < P_VALUE


def test_public_pard_directory_loads_with_its_mask_token(tmp_path):
  """A PARD drafter is an ordinary HF causal LM whose config.json names `pard_token`:
  load_parallel_draft reads both, and decodes as the draft built from the same arrays.
  The mask may also come from the tokenizer's `mask_token`; none at all is a clear error."""
  import json
  target = tiny_model("decoder_only", vocab=32, seed=3)
  drafter = tiny_model("decoder_only", vocab=32, seed=8)
  sj.export_hf(drafter, tmp_path / "pard")
  config_path = tmp_path / "pard" / "config.json"
  hf = json.loads(config_path.read_text())
  config_path.write_text(json.dumps({**hf, "pard_token": 30}))
  loaded = sj.load_parallel_draft(tmp_path / "pard", gamma=3)
  assert loaded.mask_token_id == 30 and loaded.gamma == 3
  tokens, lengths = _inputs("decoder_only", 32)
  kwargs = dict(gamma=3, max_decode_steps=10, eos_id=-1, temperature=1.0,
                rng=jax.random.PRNGKey(5))
  built = sj.ParallelDraft(drafter, mask_token_id=30, gamma=3)
  np.testing.assert_array_equal(
      np.asarray(sj.generate(target, tokens, lengths, draft=loaded, **kwargs).sequences),
      np.asarray(sj.generate(target, tokens, lengths, draft=built, **kwargs).sequences))
  config_path.write_text(json.dumps(hf))
  (tmp_path / "pard" / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<mask>"}))
  (tmp_path / "pard" / "tokenizer.json").write_text(json.dumps(
      {"added_tokens": [{"id": 29, "content": "<mask>"}], "model": {"vocab": {}}}))
  assert sj.load_parallel_draft(tmp_path / "pard").mask_token_id == 29
  (tmp_path / "pard" / "tokenizer_config.json").unlink()
  with pytest.raises(sj.CheckpointError, match="no mask token found .*pard_token.*pass "
                                               "mask_token_id="):
    sj.load_parallel_draft(tmp_path / "pard")
  assert sj.load_parallel_draft(tmp_path / "pard", mask_token_id=7).mask_token_id == 7
