"""Feature drafts (EAGLE-style): the target's features through the family contract and the
chain loop, and `FeatureDraft` decoding exactly.

The features a draft receives are checked against the target's own uncached
forward pass over the final output: at every position they are a function of
the accepted tokens only. Negative control (run by hand): an engine that hands
over the features of block positions 1..n+1 instead of 0..n (the first
rejected draft's included) fails
`test_features_handed_to_the_draft_are_a_function_of_accepted_tokens` at both
temperatures; the greedy and chi-square tests, with a random head, do not
notice it (exactness in law does not depend on what a random head reads).
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

@pytest.mark.slow
@pytest.mark.parametrize("layers", [None, (0, 1, 2), "eagle3"])
def test_feature_block_matches_block_and_uncached_forward(layers):
  model = _target()
  if layers == "eagle3":
    model = sj.load_model("llama_tiny", vocab_size=64, seed=0, dtype="float32", num_layers=7)
  family = family_of(model)
  cfg = model.config
  taps = feature_layers(cfg, layers)
  assert taps == {None: (cfg.num_layers,), "eagle3": (2, 3, 4)}.get(layers, taps)
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, 64, (2, 9)).astype(np.int32)
  lengths = jnp.array([6, 6], jnp.int32)
  start, prompt_features, memory = family.start_features(cfg, model.params, jnp.asarray(tokens[:, :6]),
                                                 lengths, 4, layers)
  assert prompt_features.shape == (2, 6, family.feature_dim(cfg, layers))
  assert memory is None
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
  # T5 now has features too; the contract's refusal for families without them:
  # tests/test_t5_feature_draft.py::test_t5_feature_errors_are_named.
  target = _target(vocab=32)
  draft = sj.FeatureDraft(target)
  # An adaptive-length feature draft: tests/test_protocol.py.
  # Trees of feature drafts: tests/test_feature_trees.py.
  other = _target(vocab=64)
  with pytest.raises(ValueError, match="another target config"):
    sj.generate(other, np.ones((1, 3), np.int32), max_decode_steps=2, draft=draft)


# ---------------------------------------------------------------------------
# 2-4. FeatureDraft through the engine: greedy identity, the target's law, what it sees.

def _cast(model, dtype):
  return family_of(model).model_type(
      model.config.replace(dtype=dtype),
      jax.tree_util.tree_map(lambda x: x.astype(dtype), model.params))


def _prompts(batch, length, vocab, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, (batch, length)).astype(np.int32)
  lengths = rng.integers(1, length + 1, batch).astype(np.int32)
  lengths[0] = length
  lengths[1] = 1  # a one-token prompt: its first pair has no feature before it
  return tokens, lengths


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [8, 64])
def test_greedy_feature_draft_equals_target_only_at_the_same_width(dtype, vocab):
  target = _cast(_target(vocab=vocab, seed=1), dtype)
  tokens, lengths = _prompts(6, 7, vocab, seed=3)
  kwargs = dict(max_decode_steps=24, block_width=8, eos_id=-1)
  want = sj.generate(target, tokens, lengths, **kwargs)
  for draft, gamma in ((sj.FeatureDraft(target, seed=2), 3), (_copy_head(target), 1),
                       (_copy_head(target), 3)):
    got = sj.generate(target, tokens, lengths, draft=draft, gamma=gamma, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
    assert got.stats.iterations.sum() > 0
  assert got.stats.accepted.sum() > 0, got.stats.summary()  # the copy head is accepted


# The statistical suite: `make test-slow`.
@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7, topk=3),
                                     dict(temperature=1.0, topp=0.8)],
                         ids=["t1", "t0.7_top3", "topp0.8"])
def test_feature_draft_samples_follow_target_distribution(setting):
  """Whole 3-token decodes over a vocabulary of 8, 10,000 samples, against the exact
  enumeration of the target's law (chi-square at 1e-4, as in test_trees.py)."""
  import test_trees
  from test_speculative import P_VALUE, _chi_square_ok
  n, steps = 10_000, 3
  target = sj.load_model("llama_tiny", vocab_size=8, seed=21, dtype="float32")
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, steps, eos, **setting)
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    draft=sj.FeatureDraft(target, seed=5), gamma=2,
                    block_width=3, rng=jax.random.PRNGKey(23), **setting)
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


def _copy_head(target, seed=0):
  """A FeatureDraft whose head passes the fed feature through (fc = [0 | I], the layer's
  output projections zeroed): it predicts the feature of the previous position, so it
  drafts repeats of the last token, which random tiny targets accept often."""
  draft = sj.FeatureDraft(target, seed=seed)
  h = target.config.emb_dim
  dtype = target.config.dtype
  params = jax.tree_util.tree_map(lambda x: x, draft.head_params)
  params["fc"]["kernel"] = jnp.concatenate([jnp.zeros((h, h)), jnp.eye(h)]).astype(dtype)
  params["layer"]["self_attn"]["o_proj"]["kernel"] = jnp.zeros_like(
      params["layer"]["self_attn"]["o_proj"]["kernel"])
  params["layer"]["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(
      params["layer"]["mlp"]["down_proj"]["kernel"])
  return sj.FeatureDraft(target, head_params=params)


class _RecordingDraft(sj.FeatureDraft):
  """A FeatureDraft that reports, at each proposal, the features it was handed."""

  def __init__(self, *args, log, **kwargs):
    super().__init__(*args, **kwargs)
    self.log = log

  def static_key(self):
    return super().static_key() + (id(self.log),)

  def proposer(self, params, plan):
    chain = super().proposer(params, plan)
    inner = chain.propose

    def record(lengths, count, offset, features):
      self.log.append(tuple(np.asarray(x) for x in (lengths, count, offset, features)))

    def propose(rng, state, sequences, lengths, max_drafted=None):
      jax.debug.callback(record, lengths, state["count"], state["offset"],
                         state["pending_features"], ordered=True)
      return inner(rng, state, sequences, lengths, max_drafted)

    return chain._replace(propose=propose)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_features_handed_to_the_draft_are_a_function_of_accepted_tokens(temperature):
  """Every feature a draft receives equals the target's uncached feature at that
  position of the final output, and nothing else arrives (zeros past the kept ones);
  two different drafts (different proposals, different acceptances, different
  iterations) are handed the same feature for the same row and accepted prefix."""
  vocab = 8
  target = _target(vocab=vocab, seed=1)
  tokens, lengths = _prompts(3, 5, vocab, seed=4)
  steps = 12
  seen = []
  for copy, gamma in ((False, 3), (True, 2)):
    log = []
    head = _copy_head(target).head_params if copy else None
    draft = _RecordingDraft(target, head_params=head, seed=2, log=log)
    out = sj.generate(target, tokens, lengths, draft=draft, gamma=gamma, block_width=8, eos_id=-1,
                      max_decode_steps=steps, temperature=temperature,
                      rng=jax.random.PRNGKey(0))
    jax.effects_barrier()
    sequences = np.asarray(out.sequences)
    if temperature == 0.0:
      np.testing.assert_array_equal(sequences, np.asarray(sj.generate(
          target, tokens, lengths, max_decode_steps=steps, block_width=8, eos_id=-1).sequences))
    at = {}
    for b in range(tokens.shape[0]):
      full = np.concatenate([tokens[b, :lengths[b]], sequences[b]])[None]
      want = _uncached_features(target, full)[0]
      for lengths_now, count, offset, features in log:
        if lengths_now[b] >= steps:
          continue
        assert 1 <= count[b] <= gamma + 1
        np.testing.assert_array_equal(features[b, count[b]:], 0.0)
        for j in range(count[b]):
          position = offset[b] + lengths_now[b] - count[b] + j  # absolute, of the feature
          if position < 0:  # the first token's pair: no feature before it
            np.testing.assert_array_equal(features[b, j], 0.0)
            continue
          np.testing.assert_allclose(features[b, j], want[position], rtol=1e-4, atol=1e-4)
          at[(b, tuple(full[0, :position + 1]))] = features[b, j]
    # Every position up to the last one handed over was handed over (the
    # final iteration's features arrive after the last proposal: unrecorded).
    for b in range(tokens.shape[0]):
      positions = sorted(len(prefix) - 1 for row, prefix in at if row == b)
      assert positions == list(range(max(lengths[b] - 2, 0), positions[-1] + 1)), positions
      assert positions[-1] >= lengths[b] + steps - 2 - (gamma + 1)
    if copy:
      assert out.stats.accepted.sum() > 0, out.stats.summary()
    seen.append((at, [tuple(entry[0]) for entry in log]))
  (first, lengths_first), (second, lengths_second) = seen
  assert lengths_first != lengths_second  # the two drafts' iterations ended elsewhere
  shared = set(first) & set(second)  # the same row and accepted prefix
  assert len(shared) >= tokens.shape[0] * 2, len(shared)
  for key in shared:
    np.testing.assert_allclose(first[key], second[key], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# 5. The EAGLE-1 loss with the trainer.

@pytest.mark.slow
def test_eagle1_loss_trains_the_head_and_raises_acceptance():
  import functools
  from specdec_jax.families.decoder_only.batch import lm_batch
  from specdec_jax.train import feature_heads as feature_train
  from specdec_jax.train import trainer
  target = _target(vocab=64, seed=0)
  rng = np.random.default_rng(0)
  prompts = rng.integers(2, 64, (32, 4)).astype(np.int32)
  samples = sj.generate(target, prompts, max_decode_steps=28, temperature=1.0, eos_id=-1,
                        rng=jax.random.PRNGKey(1)).sequences
  sequences = np.concatenate([prompts, np.asarray(samples)], axis=1)
  batch = feature_train.feature_batch(target, lm_batch(sequences,
                                                       np.full(32, sequences.shape[1])))
  draft = sj.FeatureDraft(target, seed=3)
  optimizer = trainer.make_optimizer("adamw", 3e-3)
  state = trainer.create_train_state(draft.head_params, optimizer)
  step = jax.jit(functools.partial(trainer.train_step, loss_fn=feature_train.feature_loss_fn(draft),
                                   optimizer=optimizer))
  losses = []
  for _ in range(100):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.8 * losses[0], losses[::10]
  assert float(metrics["regression"]) < 0.5 * losses[0]
  trained = sj.FeatureDraft(target, head_params=state.params)
  test_prompts = rng.integers(2, 64, (8, 4)).astype(np.int32)
  kwargs = dict(max_decode_steps=24, gamma=3, eos_id=-1, block_width=8)
  before = sj.generate(target, test_prompts, draft=draft, **kwargs).stats
  after = sj.generate(target, test_prompts, draft=trained, **kwargs)
  np.testing.assert_array_equal(np.asarray(after.sequences), np.asarray(
      sj.generate(target, test_prompts, max_decode_steps=24, eos_id=-1,
                  block_width=8).sequences))
  assert after.stats.acceptance_rate > before.acceptance_rate + 0.05, (
      before.summary(), after.stats.summary())


@pytest.mark.slow
def test_feature_draft_serves_a_tied_qwen2_target():
  """Qwen2 layout: tied head (logits through the embedding table), q/k/v biases."""
  target = sj.load_model("qwen2_tiny", vocab_size=8, seed=3, dtype="float32")
  assert target.config.tie_word_embeddings
  draft = _copy_head(target)
  assert set(draft.params["target"]) == {"embed_tokens"}
  assert draft.params["target"]["embed_tokens"]["embedding"] is (
      target.params["embed_tokens"]["embedding"])  # a reference, not a copy
  tokens, lengths = _prompts(4, 5, 8, seed=5)
  kwargs = dict(max_decode_steps=16, block_width=8, eos_id=-1)
  want = sj.generate(target, tokens, lengths, **kwargs)
  got = sj.generate(target, tokens, lengths, draft=draft, gamma=3, **kwargs)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert got.stats.accepted.sum() > 0, got.stats.summary()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_feature_draft_serves_a_learned_position_gpt2_target(dtype):
  """GPT-2 layout (learned positions, LayerNorm, tied head): the head adds the target's
  own position embedding at each pair's absolute position (a reference, like the
  embedding table); greedy outputs are the target's, and the copy head is accepted."""
  target = _cast(sj.load_model("gpt2_tiny", vocab_size=8, seed=3, dtype="float32"), dtype)
  assert not target.config.uses_rotary
  draft = _copy_head(target)
  assert set(draft.params["target"]) == {"embed_tokens", "embed_positions"}
  assert draft.params["target"]["embed_positions"]["embedding"] is (
      target.params["embed_positions"]["embedding"])
  tokens, lengths = _prompts(4, 5, 8, seed=6)
  kwargs = dict(max_decode_steps=16, block_width=8, eos_id=-1)
  want = sj.generate(target, tokens, lengths, **kwargs)
  for d, gamma in ((sj.FeatureDraft(target, seed=1), 3), (draft, 3)):
    got = sj.generate(target, tokens, lengths, draft=d, gamma=gamma, **kwargs)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert got.stats.accepted.sum() > 0, got.stats.summary()
  # The positions reach the head: the same pairs at other positions predict otherwise.
  head, params = draft.head, draft.params
  pair = (jnp.array([[3, 4]], jnp.int32), jnp.ones((1, 2, head.hidden_dim), jnp.float32))
  at = [head.apply(params["head"], params["target"], *pair, jnp.array([p], jnp.int32),
                   head.init_cache(params["head"], 1, 16))[0] for p in (0, 5)]
  assert not np.allclose(np.asarray(at[0], np.float32), np.asarray(at[1], np.float32))

@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow

def test_a_prebuilt_head_is_driven_through_the_contract():
  """FeatureDraft(target, head=...) drives any FeatureHead: here the family's own head
  behind a subclass that counts its calls; same outputs as the default head."""
  from specdec_jax.families.decoder_only.feature_head import DecoderOnlyFeatureHead
  from specdec_jax.families.feature_head import FeatureHead
  target = _target(vocab=16, seed=2)
  calls = collections.Counter()

  class Counting(DecoderOnlyFeatureHead):
    def static_key(self):
      return super().static_key() + ("counting",)

    def apply(self, *args):
      calls["apply"] += 1
      return super().apply(*args)

  head = Counting(target.config)
  assert isinstance(head, FeatureHead)
  default = sj.FeatureDraft(target, seed=4)
  prebuilt = sj.FeatureDraft(target, head=head, head_params=default.head_params)
  tokens, lengths = _prompts(3, 4, 16, seed=1)
  kwargs = dict(max_decode_steps=10, block_width=8, eos_id=-1, gamma=3, temperature=1.0,
                rng=jax.random.PRNGKey(3))
  a = sj.generate(target, tokens, lengths, draft=default, **kwargs)
  b = sj.generate(target, tokens, lengths, draft=prebuilt, **kwargs)
  np.testing.assert_array_equal(np.asarray(a.sequences), np.asarray(b.sequences))
  np.testing.assert_array_equal(a.stats.accepted, b.stats.accepted)
  assert calls["apply"] > 0  # traced through the prebuilt head
  with pytest.raises(TypeError, match="FeatureHead"):
    sj.FeatureDraft(target, head=object())
  with pytest.raises(ValueError, match="another target config"):
    sj.FeatureDraft(_target(vocab=32), head=head)
