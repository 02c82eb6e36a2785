"""Draft distillation: the divergences are right and distillation raises measured alpha."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import data
from specdec_jax.train import distill
from specdec_jax.train import trainer as train
from specdec_jax.families.t5.model import Model, init_params
from specdec_jax.families.t5.config import get_config
from specdec_jax.core.verification.token import acceptance_probability

VOCAB = 32
TARGET = get_config("tiny", vocab_size=VOCAB, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                    num_encoder_layers=1, num_decoder_layers=1, dtype="float32")
DRAFT = TARGET.replace(emb_dim=16, head_dim=8, mlp_dim=32)


def _task(n, seed):
  """Copy the input (length 6) and EOS: structure a trained target learns quickly."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(3, VOCAB, (n, 6)).astype(np.int32)
  return data.Seq2SeqData(inputs, np.concatenate([inputs, np.ones((n, 1), np.int32)], 1))


@pytest.fixture(scope="module")
def trained_target():
  task = _task(256, 0)
  opt = train.make_optimizer("adafactor", 5e-2, schedule="constant", warmup_steps=5)
  state = train.create_train_state(init_params(TARGET, 0), opt)
  state, _ = train.fit(state, lambda s: task.take(data.batch_indices(256, 32, s, 0)),
                       loss_fn=train.loss_fn(TARGET), optimizer=opt,
                       cfg=train.TrainConfig(num_steps=60, progress_bar=False))
  return Model(TARGET, state.params)


def test_divergences():
  rng = np.random.default_rng(0)
  logits_p = jnp.asarray(rng.normal(size=(2, 3, 7)) * 2, jnp.float32)
  logits_q = jnp.asarray(rng.normal(size=(2, 3, 7)) * 2, jnp.float32)
  p = jax.nn.softmax(logits_p)
  mask = jnp.ones((2, 3))
  tv = distill.divergence_sum(p, logits_q, mask, "tv", 1.0)
  beta = acceptance_probability(p.reshape(-1, 7), jax.nn.softmax(logits_q).reshape(-1, 7))
  # TV = 1 - beta: minimising it maximises the acceptance probability.
  np.testing.assert_allclose(tv, jnp.sum(1.0 - beta), rtol=1e-5)
  np.testing.assert_allclose(distill.divergence_sum(p, logits_p, mask, "forward_kl", 1.0), 0.0,
                             atol=1e-5)
  assert float(distill.divergence_sum(p, logits_q, mask, "forward_kl", 1.0)) > 0.1
  # Masked positions contribute nothing.
  half = mask.at[:, 1:].set(0.0)
  np.testing.assert_allclose(distill.divergence_sum(p, logits_q, half, "tv", 1.0),
                             jnp.sum((1.0 - beta).reshape(2, 3)[:, 0]), rtol=1e-5)
  assert distill.distill_temperature(0.0) == 1.0 and distill.distill_temperature(0.7) == 0.7
  with pytest.raises(ValueError, match="unknown divergence"):
    distill.divergence_sum(p, logits_q, mask, "js", 1.0)


@pytest.mark.parametrize("divergence", [pytest.param("forward_kl", marks=pytest.mark.slow), "tv"])
def test_distillation_raises_alpha(trained_target, divergence):
  draft = Model(DRAFT, init_params(DRAFT, 5))
  prompts = _task(32, 99).inputs  # Held-out prompts, the same before and after.
  result = distill.distill_drafts(
      trained_target, {"d": draft}, _task(512, 1), steps=60, batch_size=32,
      learning_rate=5e-2 if divergence == "forward_kl" else 1e-1, divergence=divergence,
      temperature=0.0, source="target", eval_prompts=prompts, max_decode_steps=8,
      alpha_temperatures=(0.0, 1.0), gamma=3, progress_bar=False)
  before, after = result.alpha_before["d"], result.alpha_after["d"]
  # A random draft barely agrees with the trained target; 60 distillation steps
  # must raise alpha clearly at both temperatures (~224 drafted positions each,
  # so a 0.1 rise is many standard errors).
  assert after[0.0] > before[0.0] + 0.1, (before, after)
  assert after[1.0] > before[1.0] + 0.1, (before, after)


def test_bad_input(trained_target):
  other_vocab = Model(DRAFT.replace(vocab_size=VOCAB + 1), init_params(DRAFT.replace(
      vocab_size=VOCAB + 1), 0))
  with pytest.raises(ValueError, match="vocabulary"):
    distill.distill_drafts(trained_target, {"d": other_vocab}, _task(64, 1), steps=1)
  draft = Model(DRAFT, init_params(DRAFT, 0))
  with pytest.raises(ValueError, match="unknown source"):
    distill.distill_drafts(trained_target, {"d": draft}, _task(64, 1), steps=1, source="x")
  bad = data.Seq2SeqData(np.full((4, 3), VOCAB + 5, np.int32), np.ones((4, 2), np.int32))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    distill.distill_drafts(trained_target, {"d": draft}, bad, steps=1)
  from specdec_jax.loading import load_model
  with pytest.raises(ValueError, match="the target's family"):
    distill.distill_drafts(trained_target, {"d": load_model("llama_tiny_draft")}, _task(64, 1),
                           steps=1)
  with pytest.raises(ValueError, match="reference outputs"):
    distill.distill_drafts(trained_target, {"d": draft}, _task(64, 1).inputs, steps=1,
                           source="data")


def test_ngram_from_target_samples_counts_the_targets_outputs():
  from specdec_jax.tools import testing
  from specdec_jax.drafts import NgramDraft
  from specdec_jax.generation import generate
  target = testing.tiny_pair(vocab_size=32, seed=3)[0]
  enc = testing.random_encoder_tokens(4, 5, 32, seed=3)
  rng = jax.random.PRNGKey(2)
  draft = distill.ngram_from_target_samples(target, enc, max_decode_steps=6, rng=rng)
  samples = np.asarray(generate(target, enc, max_decode_steps=6, temperature=1.0,
                                rng=rng).sequences)
  expected = NgramDraft.fit(samples, 32, order=2, eos_id=target.config.eos_id,
                            pad_id=target.config.pad_id)
  np.testing.assert_array_equal(draft.dense_bigram_counts(), expected.dense_bigram_counts())


def test_generate_targets_continue_decoder_only_prompts():
  """Decoder-only targets are prompt + continuation rows learning only the continuation,
  and the teacher's distributions line up with them."""
  from specdec_jax.generation import generate
  from specdec_jax.loading import load_model
  model = load_model("llama_tiny_draft", seed=0)
  lengths = np.array([3, 5, 1], np.int32)
  prompts = np.random.default_rng(4).integers(3, 97, (3, 5)).astype(np.int32)
  batch = distill.generate_targets(model, data.Prompts(prompts, lengths), max_decode_steps=4,
                                   batch_size=4)
  # The same program (4 rows: the last chunk is padded with copies of its first row).
  out = generate(model, np.concatenate([prompts, prompts[:1]]),
                 np.concatenate([lengths, lengths[:1]]), max_decode_steps=4)
  assert batch["tokens"].shape == (3, 9)
  for i, length in enumerate(lengths):
    n = int(out.lengths[i])
    np.testing.assert_array_equal(batch["tokens"][i, :length], prompts[i, :length])
    np.testing.assert_array_equal(batch["tokens"][i, length:length + n],
                                  np.asarray(out.sequences)[i, :n])
    assert batch["weights"][i].tolist() == [0] * length + [1] * n + [0] * (9 - length - n)
  probs = distill.teacher_probs(model, batch, temperature=1.0)
  assert probs.shape == (3, 8, model.config.vocab_size)
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-5)
