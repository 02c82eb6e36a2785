"""Drafts beyond a smaller T5: n-gram, prompt lookup, adaptive draft length.

Every draft must leave the output distribution exactly the target's: greedy
outputs token for token, sampled sequences by a chi-square test against the
target's exact sequence distribution (enumerated from teacher-forced logits).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats as scipy_stats

import specdec_jax as sj
from specdec_jax import generate
from specdec_jax.drafts import (AdaptiveGammaDraft, ModelDraft, NgramDraft, PromptLookupDraft,
                                heuristic_draft_length)
from specdec_jax.loading import load_model
from specdec_jax.core.sampling import adjust_probs
from specdec_jax.families.base import Context
from specdec_jax.tools.testing import random_encoder_tokens, tiny_pair

# One decoder/encoder layer: compile time dominates these tests.
ONE_LAYER = dict(num_encoder_layers=1, num_decoder_layers=1)
# False-alarm rate of each chi-square test.
ALPHA = 1e-3


# ---------------------------------------------------------------------------
# N-gram counts, saving, bad input (no model, no compile).

CORPUS = [[2, 3, 2, 1, 0, 0], [3, 3, 4], [4, 2, 3, 1, 5, 5]]
# After cutting at EOS (1) and dropping trailing pad (0):
#   [2, 3, 2, 1], [3, 3, 4], [4, 2, 3, 1]; contexts start at pad (0).
HAND_UNIGRAM = [0, 2, 3, 4, 2, 0]
HAND_BIGRAM = {(0, 2): 1, (2, 3): 2, (3, 2): 1, (2, 1): 1, (0, 3): 1, (3, 3): 1, (3, 4): 1,
               (0, 4): 1, (4, 2): 1, (3, 1): 1}


def test_ngram_counts_match_hand_counts():
  draft = NgramDraft.fit(CORPUS, vocab_size=6, order=2)
  np.testing.assert_array_equal(draft.unigram_counts, HAND_UNIGRAM)
  dense = np.zeros((6, 6), np.int64)
  for (a, b), c in HAND_BIGRAM.items():
    dense[a, b] = c
  np.testing.assert_array_equal(draft.dense_bigram_counts(), dense)
  unigram = NgramDraft.fit(CORPUS, vocab_size=6, order=1)
  assert unigram.order == 1
  np.testing.assert_array_equal(unigram.unigram_counts, HAND_UNIGRAM)
  # A rectangular array is read the same way as the list.
  padded = np.zeros((3, 6), np.int32)
  for i, seq in enumerate(CORPUS):
    padded[i, :len(seq)] = seq
  np.testing.assert_array_equal(NgramDraft.fit(padded, 6).dense_bigram_counts(), dense)


def test_ngram_probabilities_follow_the_smoothing_formula():
  s, vocab = 0.5, 6
  draft = NgramDraft.fit(CORPUS, vocab_size=vocab, order=2, smoothing=s)
  counts = np.array(HAND_UNIGRAM, np.float64)
  unigram = (counts + s) / (counts.sum() + s * vocab)
  dense = draft.dense_bigram_counts().astype(np.float64)
  expected = (dense + s * vocab * unigram[None]) / (dense.sum(1, keepdims=True) + s * vocab)
  got = draft.probs(draft.params, jnp.arange(vocab))
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  # Smoothing 0: maximum likelihood; an unseen context (5) falls back to the unigram.
  mle = NgramDraft.fit(CORPUS, vocab_size=vocab, order=2)
  got = np.asarray(mle.probs(mle.params, jnp.array([3, 5])))
  np.testing.assert_allclose(got[0], [0, 1 / 4, 1 / 4, 1 / 4, 1 / 4, 0], rtol=1e-6)
  np.testing.assert_allclose(got[1], counts / counts.sum(), rtol=1e-6)


def test_ngram_keeps_most_frequent_continuations():
  corpus = [[2, 3, 2, 3, 2, 4, 2, 5, 2, 5, 2, 5]]
  draft = NgramDraft.fit(corpus, vocab_size=6, max_continuations=2)
  assert draft.bigram_tokens.shape == (6, 2)
  # After 2: 5 (x3), 3 (x2), 4 (x1, dropped).
  np.testing.assert_array_equal(draft.bigram_tokens[2], [5, 3])
  np.testing.assert_array_equal(draft.bigram_counts[2], [3, 2])
  np.testing.assert_allclose(float(jnp.sum(draft.probs(draft.params, jnp.array([2])))), 1.0,
                             rtol=1e-6)


def test_ngram_save_load_round_trip(tmp_path):
  for order in (1, 2):
    draft = NgramDraft.fit(CORPUS, vocab_size=6, order=order, smoothing=0.25)
    path = tmp_path / f"ngram{order}.npz"
    draft.save(path)
    loaded = NgramDraft.load(path)
    assert loaded.static_key() == draft.static_key()
    assert loaded.smoothing == 0.25 and loaded.order == order
    for a, b in zip(jax.tree_util.tree_leaves(draft.params),
                    jax.tree_util.tree_leaves(loaded.params)):
      np.testing.assert_array_equal(a, b)
  assert [p.name for p in tmp_path.iterdir()] != []
  assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_ngram_bad_input_gives_clear_errors(tmp_path):
  with pytest.raises(ValueError, match=r"token 6 at position 1, outside the vocabulary \[0, 6\)"):
    NgramDraft.fit([[2, 3], [2, 6]], vocab_size=6)
  with pytest.raises(ValueError, match="token -1"):
    NgramDraft.fit([[2, -1]], vocab_size=6)
  with pytest.raises(ValueError, match="order must be 1"):
    NgramDraft.fit(CORPUS, vocab_size=6, order=3)
  with pytest.raises(ValueError, match="integer token ids"):
    NgramDraft.fit([[2.0, 3.0]], vocab_size=6)
  with pytest.raises(ValueError, match="corpus is empty"):
    NgramDraft.fit([[0, 0]], vocab_size=6)
  with pytest.raises(ValueError, match="smoothing"):
    NgramDraft.fit(CORPUS, vocab_size=6, smoothing=-1)
  np.savez(tmp_path / "other.npz", weights=np.zeros(3))
  with pytest.raises(ValueError, match="not an NgramDraft file"):
    NgramDraft.load(tmp_path / "other.npz")




# ---------------------------------------------------------------------------
# Prompt lookup and the schedule, on hand-made states (no model).

def test_prompt_lookup_finds_the_longest_then_earliest_match():
  draft = PromptLookupDraft(vocab_size=10, max_ngram=2, min_ngram=1)
  encoder = jnp.array([[5, 6, 7, 5, 8, 0, 0],    # "5 6" occurs once: continue with 7.
                       [5, 6, 7, 5, 8, 0, 0],    # "9" only in the output: continue after it.
                       [5, 6, 7, 5, 8, 0, 0],    # "3" nowhere: no proposal.
                       [5, 6, 7, 5, 8, 0, 0],    # Nothing generated: the input's start.
                       [5, 6, 7, 5, 8, 0, 0]])   # "8" ends the input: its successor is pad.
  sequences = jnp.array([[0, 5, 6, 0, 0, 0],
                         [0, 9, 4, 2, 9, 0],
                         [0, 3, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0],
                         [0, 8, 0, 0, 0, 0]])
  lengths = jnp.array([2, 4, 1, 0, 1])
  propose = draft.proposer(draft.params, sj.ProposalPlan(sj.Sampling(1.0), 3, 4)).propose
  # A T5 context: the encoder input, which the generated tokens do not continue.
  encoder = Context(encoder, jnp.full((5,), 5), continued=False)
  tokens, probs, num_drafted, _ = propose(jax.random.PRNGKey(0), encoder, sequences, lengths)
  np.testing.assert_array_equal(num_drafted, [3, 3, 0, 3, 0])
  np.testing.assert_array_equal(tokens, [[7, 5, 8], [4, 2, 9], [0, 0, 0], [5, 6, 7], [0, 0, 0]])
  np.testing.assert_array_equal(probs, jax.nn.one_hot(tokens, 10) *
                                (jnp.arange(3) < num_drafted[:, None])[..., None])
  # The continuation stops at the end of its segment; max_drafted caps it.
  tokens, _, num_drafted, _ = propose(jax.random.PRNGKey(0), encoder,
                                      jnp.array([[0, 7, 0, 0, 0, 0]] * 5), jnp.array([1] * 5),
                                      max_drafted=jnp.array([3, 1, 3, 3, 3]))
  np.testing.assert_array_equal(num_drafted, [2, 1, 2, 2, 2])
  np.testing.assert_array_equal(tokens[0], [5, 8, 0])


def test_heuristic_schedule():
  got = heuristic_draft_length(jnp.array([1, 3, 4, 1, 5]),
                               jnp.array([True, True, True, False, False]), gamma_max=5)
  np.testing.assert_array_equal(got, [3, 5, 5, 1, 4])


# ---------------------------------------------------------------------------
# Greedy exactness on a noisy tiny pair (vocab 64).

@pytest.fixture(scope="module")
def greedy_setup():
  target, draft_model = tiny_pair(vocab_size=64, noise=0.3, **ONE_LAYER)
  tokens = random_encoder_tokens(6, 7, 64, seed=3)
  reference = generate(target, tokens, max_decode_steps=12)
  # Rows end early on EOS (the decode must handle them).
  assert int(jnp.min(reference.lengths)) < 12 and int(jnp.max(reference.lengths)) == 12
  return target, draft_model, tokens, reference


def test_draft_vocabulary_must_match_the_target(greedy_setup):
  target, _, tokens, _ = greedy_setup
  for draft in (NgramDraft.fit(CORPUS, vocab_size=6), PromptLookupDraft(vocab_size=6),
                AdaptiveGammaDraft(PromptLookupDraft(vocab_size=6))):
    with pytest.raises(ValueError, match="vocabulary size 6 differs from the target's 64"):
      generate(target, tokens, max_decode_steps=4, draft=draft)
  with pytest.raises(ValueError, match="eos_id 2 differs"):
    generate(target, tokens, max_decode_steps=4,
             draft=load_model(target.config.replace(eos_id=2)))


def _adaptive_model_draft(model, threshold):
  return AdaptiveGammaDraft(ModelDraft(model, confidence_threshold=threshold), initial_gamma=2)


# Random vocab-64 models put 0.06-0.15 on their top token: 0.09 stops about half.
GREEDY_THRESHOLD = 0.09


@pytest.mark.parametrize("kind", ["unigram", "bigram", "prompt_lookup", "adaptive_model"])
def test_greedy_output_equals_target(greedy_setup, kind):
  target, draft_model, tokens, reference = greedy_setup
  corpus = np.asarray(reference.sequences)
  draft = {
      "unigram": lambda: NgramDraft.fit(corpus, 64, order=1, smoothing=0.1),
      "bigram": lambda: NgramDraft.fit(corpus, 64, order=2),
      "prompt_lookup": lambda: PromptLookupDraft(64),
      "adaptive_model": lambda: _adaptive_model_draft(draft_model, GREEDY_THRESHOLD),
  }[kind]()
  out = generate(target, tokens, max_decode_steps=12, draft=draft, gamma=4)
  np.testing.assert_array_equal(out.sequences, reference.sequences)
  np.testing.assert_array_equal(out.lengths, reference.lengths)
  assert 0.0 < out.stats.acceptance_rate < 1.0, out.stats.summary()
  emitted = out.stats.accepted + out.stats.iterations
  np.testing.assert_array_equal(emitted, out.lengths)


def test_adaptive_model_draft_keeps_its_cache_consistent(greedy_setup):
  """With the target as its own draft every greedy draft must be accepted.

  A draft cache that missed a position when a row stopped drafting early
  (confidence) or late (schedule) would predict differently and be rejected.
  """
  target, _, tokens, reference = greedy_setup
  draft = _adaptive_model_draft(target, GREEDY_THRESHOLD)  # Same compile as above.
  out = generate(target, tokens, max_decode_steps=12, draft=draft, gamma=4)
  np.testing.assert_array_equal(out.sequences, reference.sequences)
  s = out.stats
  np.testing.assert_array_equal(s.accepted_raw, s.drafted)
  # Both mechanisms cut proposals short: fewer drafted than gamma per
  # iteration, yet more than one on some iterations.
  assert s.iterations.sum() < s.drafted.sum() < 4 * s.iterations.sum(), s.summary()
  assert s.position_drafted[:, 3].sum() < s.position_drafted[:, 0].sum()


# ---------------------------------------------------------------------------
# Sampling exactness on a tiny vocabulary: whole sequences of 3 tokens.

VOCAB, STEPS, SAMPLES = 8, 3, 12_000
SAMPLING_INPUT = jnp.array([[3, 5, 2, 7, 4, 1]])


@pytest.fixture(scope="module")
def sampling_setup():
  # A deliberately bad draft (noise 1.0): acceptance well inside (0, 1).
  target, draft_model = tiny_pair(vocab_size=VOCAB, noise=1.0, **ONE_LAYER)
  sequences = np.array(list(itertools.product(range(VOCAB), repeat=STEPS)), np.int32)
  decoder_inputs = np.concatenate([np.zeros((len(sequences), 1), np.int32),
                                   sequences[:, :-1]], axis=1)
  encoder = jnp.repeat(SAMPLING_INPUT, len(sequences), axis=0)
  logits = {name: m.logits(encoder, decoder_inputs) for name, m in
            (("target", target), ("draft", draft_model))}
  return target, draft_model, sequences, logits


def _canonical_index(sequences, eos_id=1):
  """Zeros after the first EOS (what a decode holds), as one int per sequence."""
  after_eos = np.cumsum(np.cumsum(sequences == eos_id, axis=1), axis=1) > 1
  canonical = np.where(after_eos, 0, sequences)
  return canonical @ (VOCAB ** np.arange(STEPS - 1, -1, -1))


def _sequence_distribution(sequences, logits, temperature, topk, topp):
  """Exact probabilities [VOCAB**STEPS] of decodes, indexed by `_canonical_index`."""
  probs = np.asarray(adjust_probs(logits, temperature, topk, topp), np.float64)
  token_probs = np.take_along_axis(probs, sequences[:, :, None], axis=2)[..., 0]
  # Past EOS nothing is drawn: those factors are 1.
  after_eos = np.cumsum(np.cumsum(sequences == 1, axis=1), axis=1) > 1
  mass = np.prod(np.where(after_eos, 1.0, token_probs), axis=1)
  # Each decode's probability is spread over VOCAB**k enumerated tails past EOS.
  tails = np.sum(after_eos, axis=1)
  return np.bincount(_canonical_index(sequences), weights=mass / VOCAB ** tails,
                     minlength=VOCAB ** STEPS)


def _chi_square_pvalue(counts, probs, min_expected=5.0):
  """Pearson's test; cells expected below min_expected are pooled into one."""
  expected = probs * counts.sum()
  big = expected >= min_expected
  observed, expected = counts[big], expected[big]
  # Cells the target cannot produce are checked separately (their count must be 0).
  pooled = probs[~big].sum() * counts.sum()
  if pooled > 0:
    observed = np.append(observed, counts[~big].sum())
    expected = np.append(expected, pooled)
  statistic = np.sum((observed - expected) ** 2 / expected)
  return scipy_stats.chi2.sf(statistic, len(observed) - 1)


SAMPLING_CASES = {
    # kind: (temperature, topk, topp)
    "unigram": (1.0, 0, 0.0),
    "bigram": (0.7, 0, 0.9),
    "prompt_lookup": (0.8, 4, 0.0),
    "adaptive_model": (1.0, 0, 0.0),
}


@pytest.mark.parametrize("kind", list(SAMPLING_CASES))
def test_sampled_sequences_follow_the_target_distribution(sampling_setup, kind):
  target, draft_model, sequences, logits = sampling_setup
  temperature, topk, topp = SAMPLING_CASES[kind]
  # Small corpora: q has zeros where p has mass, and unseen contexts.
  corpus = [[3, 5, 2, 1], [5, 5, 6, 2, 7, 1], [2, 2, 3]]
  draft = {
      "unigram": lambda: NgramDraft.fit(corpus, VOCAB, order=1),
      "bigram": lambda: NgramDraft.fit(corpus, VOCAB, order=2),
      "prompt_lookup": lambda: PromptLookupDraft(VOCAB, max_ngram=2),
      # Noise-1.0 draft models put 0.4-0.9 on their top token.
      "adaptive_model": lambda: _adaptive_model_draft(draft_model, 0.5),
  }[kind]()
  out = generate(target, jnp.repeat(SAMPLING_INPUT, SAMPLES, axis=0), max_decode_steps=STEPS,
                 temperature=temperature, topk=topk, topp=topp, draft=draft, gamma=2,
                 rng=jax.random.PRNGKey(7))
  assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.summary()
  if kind == "adaptive_model":
    assert out.stats.drafted.sum() < 2 * out.stats.iterations.sum()
  counts = np.bincount(_canonical_index(np.asarray(out.sequences)), minlength=VOCAB ** STEPS)
  expected = _sequence_distribution(sequences, logits["target"], temperature, topk, topp)
  assert counts[expected == 0].sum() == 0, "sampled a sequence the target cannot produce"
  p_value = _chi_square_pvalue(counts, expected)
  assert p_value > ALPHA, f"{kind}: p = {p_value:.2e}, {out.stats.summary()}"
  if kind == "adaptive_model":
    # The test has power: the same samples reject the draft's own distribution.
    draft_expected = _sequence_distribution(sequences, logits["draft"], temperature, topk, topp)
    assert _chi_square_pvalue(counts, draft_expected + 1e-12) < ALPHA


# ---------------------------------------------------------------------------
# Prompt lookup on a copy task.

def _train_copy_model(vocab=32, length=8, batch=64, steps=300, learning_rate=5e-3):
  """A one-layer T5 trained to output its input (distinct tokens, then EOS)."""
  model = load_model("tiny", vocab_size=vocab, dtype="float32", seed=0, **ONE_LAYER)
  module = model.module

  def make_batch(rng):
    rows = jax.vmap(lambda k: jax.random.permutation(k, jnp.arange(2, vocab))[:length])(
        jax.random.split(rng, batch))
    tokens = jnp.concatenate([rows, jnp.ones((batch, 1), jnp.int32)], axis=1)
    return tokens, jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)))

  def loss_fn(params, tokens, decoder_inputs):
    logits = module.apply({"params": params}, tokens, decoder_inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  optimizer = optax.adam(learning_rate)

  @jax.jit
  def train_step(params, opt_state, rng):
    tokens, decoder_inputs = make_batch(rng)
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, decoder_inputs)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state = model.params, optimizer.init(model.params)
  for step in range(steps):
    params, opt_state, loss = train_step(params, opt_state, jax.random.PRNGKey(step))
  return type(model)(model.config, params), make_batch, float(loss)

@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow

def test_prompt_lookup_accepts_almost_everything_on_a_copy_task():
  model, make_batch, loss = _train_copy_model()
  inputs, _ = make_batch(jax.random.PRNGKey(10_000))  # Not a training batch.
  inputs = inputs[:16]
  out = generate(model, inputs, max_decode_steps=inputs.shape[1],
                 draft=PromptLookupDraft(32), gamma=4)
  copied = np.mean(np.all(np.asarray(out.sequences) == np.asarray(inputs), axis=1))
  assert copied >= 0.9, f"the model did not learn to copy (loss {loss:.3f})"
  assert out.stats.acceptance_rate > 0.9, out.stats.summary()
  assert out.stats.mean_tokens_per_iteration > 3.0, out.stats.summary()


def test_model_draft_cache_holds_every_accepted_position(greedy_setup):
  """Direct check of the draft cache under adaptive lengths.

  Before each proposal at length n, the draft's cache must hold, at positions
  0..n-2, the keys/values of the tokens the row actually has (the proposer
  refeeds positions n-1 and n itself), whatever was drafted and accepted
  before. Compared against one teacher-forced block over the whole prefix.
  """
  _, draft_model, _, _ = greedy_setup
  draft = ModelDraft(draft_model, confidence_threshold=GREEDY_THRESHOLD)
  gamma, batch, max_len = 4, 4, 24
  encoder = random_encoder_tokens(batch, 5, 64, seed=5)
  propose = jax.jit(draft.proposer(draft.params,
                                   sj.ProposalPlan(sj.Sampling(1.0), gamma, gamma + 1)).propose)
  context = Context(encoder, jnp.full((batch,), 5))
  state = draft.init_state(draft.params, sj.DraftStart(context, max_len, gamma))
  fresh = state["cache"]
  block_fn = jax.jit(draft_model.block_fn())
  sequences = np.zeros((batch, max_len + 1), np.int32)
  lengths = np.zeros((batch,), np.int32)
  rng = np.random.default_rng(0)
  drafted_lengths = set()
  for step in range(5):
    max_drafted = jnp.asarray(rng.integers(1, gamma + 1, batch), jnp.int32)
    tokens, _, num_drafted, state = propose(jax.random.PRNGKey(step), state,
                                            jnp.asarray(sequences), jnp.asarray(lengths),
                                            max_drafted=max_drafted)
    cache = state["cache"]
    tokens, num_drafted = np.asarray(tokens), np.asarray(num_drafted)
    assert np.all((1 <= num_drafted) & (num_drafted <= np.asarray(max_drafted)))
    drafted_lengths.update(num_drafted.tolist())
    for b in range(batch):
      # Any outcome of the rejection rule: keep a drafts, then one new token.
      accepted = int(rng.integers(0, num_drafted[b] + 1))
      new = list(tokens[b, :accepted]) + [int(rng.integers(2, 64))]
      sequences[b, lengths[b] + 1:lengths[b] + 1 + len(new)] = new
      lengths[b] += len(new)
    # Teacher-forced keys/values of every row's whole prefix.
    _, reference = block_fn(jnp.asarray(sequences[:, :max_len]), jnp.zeros((batch,), jnp.int32),
                            fresh)
    for layer, ref_layer in zip(cache["layers"], reference["layers"]):
      for name in ("self_key", "self_value"):
        for b in range(batch):
          seen = lengths[b] - 1
          np.testing.assert_allclose(layer[name][b, :, :seen], ref_layer[name][b, :, :seen],
                                     atol=1e-5, err_msg=f"step {step} row {b} {name}")
  assert len(drafted_lengths) >= 3, drafted_lengths


def test_a_subclass_that_overrides_a_method_gets_its_own_program():
  """Compiled programs are keyed by `Draft.compile_key` (the class and `static_key`): a
  subclass with its parent's static_key but its own `proposer` is traced, not served the
  parent's cached program (a broken variant would otherwise pass an exactness test)."""
  from tiny_models import tiny_model
  target = tiny_model("decoder_only", vocab=16, seed=3)
  drafter = tiny_model("decoder_only", vocab=16, seed=5)
  traced = []

  class Recording(ModelDraft):
    def proposer(self, params, plan):
      traced.append(plan.gamma)
      return super().proposer(params, plan)

  prompts = np.array([[3, 4, 5]], np.int32)
  plain = generate(target, prompts, max_decode_steps=6, draft=ModelDraft(drafter), gamma=2)
  recorded = generate(target, prompts, max_decode_steps=6, draft=Recording(drafter), gamma=2)
  assert traced == [2]
  np.testing.assert_array_equal(np.asarray(recorded.sequences), np.asarray(plain.sequences))
  many = sj.generate_many(target, np.repeat(prompts, 2, 0), batch_size=1, max_decode_steps=6,
                          draft=Recording(drafter), gamma=2)
  assert traced[1:] and set(traced) == {2}
  np.testing.assert_array_equal(np.asarray(many.sequences)[0], np.asarray(plain.sequences)[0])
