"""T5 feature drafts: the T5 family's features through the contract, and a T5 feature head
(one decoder layer that also cross-attends to the target's encoder outputs) decoding
exactly through `generate`.

Statistical test: chi-square at a false-alarm rate of 1e-4 (P_VALUE, as in
test_speculative.py), 10,000 whole 3-token decodes over a vocabulary of 8
against the exact enumeration of the target's law (the target and encoder
row of test_speculative.py). Power, from the ncx2 law over the test's own
cells (291, 26 and 100 degrees of freedom at t1, t0.7_top3, topp0.8): any
output law with chi-square effect sum((p_wrong - p)^2 / p) >= 0.018, 0.0075
and 0.012 respectively is caught with power >= 0.99; the wrong rules of
test_speculative.py's docstring (residual from p, accept with r < q / p,
bonus from q) move these laws by far more.

Negative control (run by hand): an engine that hands the draft the features of
block positions 1..n+1 instead of 0..n fails
`test_t5_features_handed_to_the_draft_are_a_function_of_accepted_tokens` at
both temperatures.

The features a T5 draft receives are checked against the target's own uncached
teacher-forced decoder over the final output, at every position.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.base import Family
from specdec_jax.families.feature_head import feature_taps
from specdec_jax.families.registry import family_of
from specdec_jax.families.t5.network import T5, Decoder
from specdec_jax.tools import testing

# A FeatureDraft that reports, at each proposal, the features it was handed.
from test_feature_draft import _RecordingDraft


def _target(vocab=64, seed=0, dtype="float32", **overrides):
  return sj.load_model("tiny", vocab_size=vocab, seed=seed, dtype=dtype, **overrides)


def _cast(model, dtype):
  return family_of(model).model_type(
      model.config.replace(dtype=dtype),
      jax.tree_util.tree_map(lambda x: x.astype(dtype), model.params))


def _decoder_features(model, encoder_tokens, decoder_inputs, layers=None):
  """Uncached teacher-forced features [batch, T, f] (the reference network)."""
  taps = feature_taps(model.config.num_decoder_layers, layers)
  run = jax.jit(lambda p, e, d: T5(model.config).apply(
      {"params": p}, e, d, taps, method=T5.decoder_features))
  return np.asarray(run(model.params, jnp.asarray(encoder_tokens), jnp.asarray(decoder_inputs)))


# ---------------------------------------------------------------------------
# 1. The family capability.

@pytest.mark.slow
@pytest.mark.parametrize("layers", [None, (0, 1, 2), "eagle3"])
def test_t5_feature_block_matches_block_and_uncached_forward(layers):
  model = _target(num_decoder_layers=3) if layers == "eagle3" else _target()
  family = family_of(model)
  cfg = model.config
  taps = feature_taps(cfg.num_decoder_layers, layers)
  assert taps == {None: (2,), "eagle3": (0, 1, 2)}.get(layers, taps)
  enc = np.asarray(testing.random_encoder_tokens(2, 7, 64, seed=1, min_length=3))
  tokens, lengths = family.check_inputs(cfg, enc, None, 8)
  start, prompt_features, memory = family.start_features(cfg, model.params, tokens, lengths, 8,
                                                         layers)
  f = family.feature_dim(cfg, layers)
  assert f == len(taps) * cfg.emb_dim
  assert prompt_features.shape == (2, 0, f)  # the decoder starts from its start token alone
  plain = family.start(cfg, model.params, tokens, lengths, 8)
  for got, want in zip(jax.tree_util.tree_leaves(start), jax.tree_util.tree_leaves(plain)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_allclose(np.asarray(memory["encoded"]), np.asarray(model.encode(enc)),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(memory["encoder_mask"]), enc != 0)

  rng = np.random.default_rng(0)
  decoder_inputs = np.concatenate([np.zeros((2, 1), np.int32),
                                   rng.integers(2, 64, (2, 7)).astype(np.int32)], axis=1)
  want = _decoder_features(model, enc, decoder_inputs, layers)
  feature_block = family.feature_block_fn(cfg, model.params, layers)
  block = family.block_fn(cfg, model.params)
  cache, plain_cache = start.cache, start.cache
  for lo, hi in ((0, 5), (5, 8)):
    chunk = jnp.asarray(decoder_inputs[:, lo:hi])
    positions = jnp.full((2,), lo, jnp.int32)
    logits, features, cache = feature_block(chunk, positions, cache)
    want_logits, plain_cache = block(chunk, positions, plain_cache)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want_logits))
    np.testing.assert_allclose(np.asarray(features), want[:, lo:hi], rtol=2e-5, atol=2e-5)
    if layers is None:  # After the final norm: the logits are its projection.
      head = Decoder(cfg).apply({"params": model.params["decoder"]}, features,
                                model.params["token_embedder"]["embedding"],
                                method=Decoder.project_logits)
      np.testing.assert_allclose(np.asarray(head), np.asarray(logits), rtol=1e-5, atol=1e-5)
  for got, want_leaf in zip(jax.tree_util.tree_leaves(cache),
                            jax.tree_util.tree_leaves(plain_cache)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_leaf))


def test_t5_feature_errors_are_named():
  t5 = _target(vocab=32)
  with pytest.raises(ValueError, match="three distinct layers only for targets of 3 or at "
                                       "least 7 layers; this target has 2"):
    family_of(t5).feature_dim(t5.config, "eagle3")
  with pytest.raises(ValueError, match="has no bias"):
    sj.FeatureDraft(t5, fc_bias=True)
  draft = sj.FeatureDraft(t5)
  with pytest.raises(ValueError, match="needs memory"):
    draft.head.init_cache(draft.head_params, 1, 4, None)
  with pytest.raises(ValueError, match="another target config"):
    sj.generate(_target(vocab=64), np.ones((1, 3), np.int32), max_decode_steps=2, draft=draft)
  # The contract's default for families without features names the family.
  for method, args in ((Family.feature_dim, (t5.config,)), (Family.feature_head, (t5.config,))):
    with pytest.raises(ValueError, match="does not expose its hidden states"):
      method(family_of(t5), *args)


# ---------------------------------------------------------------------------
# 2-4. FeatureDraft through the engine.

def _copy_head(target, seed=0):
  """A T5 FeatureDraft whose head passes the fed feature through (fc = [0 | I], the
  layer's self-attention, cross-attention and MLP outputs zeroed): it predicts the
  previous position's feature, so it drafts repeats of the last token, which random
  tiny targets accept often."""
  draft = sj.FeatureDraft(target, seed=seed)
  h = target.config.emb_dim
  params = jax.tree_util.tree_map(lambda x: x, draft.head_params)
  params["fc"]["kernel"] = jnp.concatenate([jnp.zeros((h, h)), jnp.eye(h)]).astype(
      target.config.dtype)
  layer = params["layer"]
  for block, name in (("self_attention", "out"), ("encoder_decoder_attention", "out"),
                      ("mlp", "wo")):
    layer[block][name]["kernel"] = jnp.zeros_like(layer[block][name]["kernel"])
  return sj.FeatureDraft(target, head_params=params)


def _encoder_rows(batch, width, vocab, seed):
  """Encoder rows of different lengths, EOS-terminated, 0-padded."""
  rng = np.random.default_rng(seed)
  rows = np.zeros((batch, width), np.int32)
  for b in range(batch):
    n = width if b == 0 else int(rng.integers(1, width))
    rows[b, :n - 1] = rng.integers(2, vocab, n - 1)
    rows[b, n - 1] = 1
  return rows


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_t5_greedy_feature_draft_equals_target_only_at_the_same_width(dtype):
  target = _cast(_target(vocab=16, seed=1), dtype)
  enc = _encoder_rows(5, 7, 16, seed=3)
  kwargs = dict(max_decode_steps=20, block_width=8, eos_id=-1)
  want = sj.generate(target, enc, **kwargs)
  for draft, gamma in ((sj.FeatureDraft(target, seed=2), 3), (_copy_head(target), 3)):
    got = sj.generate(target, enc, draft=draft, gamma=gamma, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert got.stats.accepted.sum() > 0, got.stats.summary()  # the copy head is accepted
  # The head's refs are the target's arrays, not copies.
  assert draft.params["target"]["token_embedder"]["embedding"] is (
      target.params["token_embedder"]["embedding"])


@pytest.mark.slow
def test_t5_feature_head_reads_the_encoder_outputs():
  """The head's cross-attention sees the memory: other encoder inputs, other drafts
  (the same decoder prefix), and a tied (original T5) target is served too."""
  target = _target(vocab=16, seed=4, mlp_activations=("relu",), logits_via_embedding=True)
  draft = sj.FeatureDraft(target, seed=5)
  assert set(draft.params["target"]["decoder"]) == set()  # tied: the embedding alone
  family = family_of(target)
  a, b = _encoder_rows(2, 6, 16, seed=7)
  outs = []
  for row in (a, b):
    tokens, lengths = family.check_inputs(target.config, row[None], None, 4)
    _, _, memory = family.start_features(target.config, target.params, tokens, lengths, 4)
    head, params = draft.head, draft.params
    cache = head.init_cache(params["head"], 1, 8, memory)
    hidden, _ = head.apply(params["head"], params["target"], jnp.zeros((1, 1), jnp.int32),
                           jnp.zeros((1, 1, head.hidden_dim)), jnp.zeros((1,), jnp.int32), cache)
    outs.append(np.asarray(head.logits(params["head"], params["target"], hidden)))
  assert not np.allclose(outs[0], outs[1])
  enc = _encoder_rows(3, 6, 16, seed=8)
  kwargs = dict(max_decode_steps=12, block_width=8, eos_id=-1)
  np.testing.assert_array_equal(
      np.asarray(sj.generate(target, enc, draft=draft, gamma=2, **kwargs).sequences),
      np.asarray(sj.generate(target, enc, **kwargs).sequences))


# The statistical suite: `make test-slow`.
@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7, topk=3),
                                     dict(temperature=1.0, topp=0.8)],
                         ids=["t1", "t0.7_top3", "topp0.8"])
def test_t5_feature_draft_samples_follow_target_distribution(setting):
  from test_speculative import P_VALUE, _chi_square_ok, _exact_sequence_distribution
  vocab, steps, n = 8, 3, 10_000
  target = _target(vocab=vocab, seed=11)
  enc_row = np.array([5, 3, 7, 2], np.int32)
  expected = _exact_sequence_distribution(target, enc_row, steps, eos_id=1, **setting)
  out = sj.generate(target, np.repeat(enc_row[None], n, axis=0), max_decode_steps=steps,
                    draft=_copy_head(target), gamma=2, block_width=3,
                    rng=jax.random.PRNGKey(29), **setting)
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert len(observed) > 10
  assert _chi_square_ok(observed, expected, n) > P_VALUE


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_t5_features_handed_to_the_draft_are_a_function_of_accepted_tokens(temperature):
  """Every feature a T5 draft receives equals the target's uncached teacher-forced
  feature at that decoder position of the final output (zeros past the kept ones);
  two different drafts are handed the same feature for the same row and prefix."""
  vocab, steps = 8, 12
  target = _target(vocab=vocab, seed=1)
  enc = _encoder_rows(3, 5, vocab, seed=4)
  seen = []
  for copy, gamma in ((False, 3), (True, 2)):
    log = []
    head = _copy_head(target).head_params if copy else None
    draft = _RecordingDraft(target, head_params=head, seed=2, log=log)
    out = sj.generate(target, enc, draft=draft, gamma=gamma, block_width=8, eos_id=-1,
                      max_decode_steps=steps, temperature=temperature,
                      rng=jax.random.PRNGKey(0))
    jax.effects_barrier()
    sequences = np.asarray(out.sequences)
    if temperature == 0.0:
      np.testing.assert_array_equal(sequences, np.asarray(sj.generate(
          target, enc, max_decode_steps=steps, block_width=8, eos_id=-1).sequences))
    inputs = np.concatenate([np.zeros((enc.shape[0], 1), np.int32), sequences], axis=1)
    want = _decoder_features(target, enc, inputs)
    at = {}
    for b in range(enc.shape[0]):
      for lengths_now, count, offset, features in log:
        if lengths_now[b] >= steps:
          continue
        assert offset[b] == 0
        assert 1 <= count[b] <= gamma + 1
        np.testing.assert_array_equal(features[b, count[b]:], 0.0)
        for j in range(count[b]):
          position = lengths_now[b] - count[b] + j  # of the feature
          if position < 0:  # the start token's pair: no feature before it
            np.testing.assert_array_equal(features[b, j], 0.0)
            continue
          np.testing.assert_allclose(features[b, j], want[b, position], rtol=1e-4, atol=1e-4)
          at[(b, tuple(inputs[b, :position + 1]))] = features[b, j]
    for b in range(enc.shape[0]):
      positions = sorted(len(prefix) - 1 for row, prefix in at if row == b)
      assert positions == list(range(0, positions[-1] + 1)), positions
      assert positions[-1] >= steps - 1 - (gamma + 1)
    if copy:
      assert out.stats.accepted.sum() > 0, out.stats.summary()
    seen.append((at, [tuple(entry[0]) for entry in log]))
  (first, lengths_first), (second, lengths_second) = seen
  assert lengths_first != lengths_second
  shared = set(first) & set(second)  # the same row and decoder prefix
  # Sampled rows of two drafts part after a token or two (the encoder input is
  # not a shared prefix here, unlike a decoder-only prompt); greedy rows never do.
  assert len(shared) >= enc.shape[0] * (1 if temperature else steps - gamma - 2), len(shared)
  for key in shared:
    np.testing.assert_allclose(first[key], second[key], rtol=1e-5, atol=1e-5)
