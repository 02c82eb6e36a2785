"""Losses for training and distilling decoder-only models with `specdec_jax.train.trainer`.

`train.train_step` / `train.fit` take any `loss_fn(params, batch) -> (summed
loss, aux with 'tokens')`; these are the decoder-only ones. Batches are

  tokens:  [batch, T] int32, each row a sequence (prompt then continuation),
           right-padded;
  weights: [batch, T] float32, 1 where token t is a training target (predicted
           from tokens < t), 0 on padding and on prompt tokens not to be
           learned; weights[:, 0] is ignored (nothing predicts the first token);
  teacher_probs (distillation only): [batch, T - 1, vocab] float32, the
           target's adjusted distributions for tokens 1..T-1.

The draft distillation objective is `distill.divergence_sum` (forward KL or
TV = 1 - beta against the target's adjusted p), as for T5;
`distill_decoder_only_drafts` runs it end to end (target continuations of
prompts, teacher passes, optimizer steps) and measures alpha before and after.
"""

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import sampling
from specdec_jax.train import trainer as train
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.train.distill import DIVERGENCES, divergence_sum
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.network import DecoderOnly

Array = jax.Array


def lm_batch(sequences, lengths, prompt_lengths=None) -> Dict[str, np.ndarray]:
  """A causal-LM batch from right-padded sequences [batch, T] and their lengths [batch].

  With `prompt_lengths` [batch], only the continuation (tokens at positions >=
  prompt_length) is learned; otherwise every token after the first.
  """
  tokens = np.asarray(sequences, np.int32)
  positions = np.arange(tokens.shape[1])[None]
  lengths = np.asarray(lengths)[:, None]
  start = 1 if prompt_lengths is None else np.maximum(np.asarray(prompt_lengths)[:, None], 1)
  weights = ((positions >= start) & (positions < lengths)).astype(np.float32)
  return dict(tokens=tokens, weights=weights)


def lm_windows(texts, tokenizer, length: int, eos_id: int) -> np.ndarray:
  """Fixed-length training windows [n, length] int32 from a corpus.

  Each text (e.g. `data.SourceFile.text`) is tokenized line by line
  (`tokenizer.encode_lines`, as the T5 demo data) and ended with `eos_id`;
  the texts are concatenated in order and cut into consecutive windows, the
  remainder dropped. Every window token is a target (`lm_batch(windows,
  [length] * n)`), so documents follow each other across EOS as in GPT-style
  pretraining.
  """
  if int(length) != length or length < 2:
    raise ValueError(f"length must be an int >= 2, got {length!r}")
  stream = []
  for text in texts:
    stream.extend(tokenizer.encode_lines(text))
    stream.append(int(eos_id))
  n = len(stream) // length
  if n == 0:
    raise ValueError(f"the corpus has {len(stream)} tokens, fewer than one window of {length}")
  return np.asarray(stream[:n * length], np.int32).reshape(n, length)


def _next_token_logits(module: DecoderOnly, params, tokens: Array) -> Array:
  """Logits [batch, T - 1, vocab] predicting tokens 1..T-1 from the tokens before."""
  return module.apply({"params": params}, tokens[:, :-1])


def causal_lm_loss_fn(config: DecoderOnlyConfig) -> train.LossFn:
  """Next-token cross-entropy (summed over weighted tokens) on {'tokens', 'weights'}."""
  module = DecoderOnly(config)

  def loss_fn(params, batch):
    tokens = batch["tokens"]
    mask = batch["weights"][:, 1:].astype(jnp.float32)
    logits = _next_token_logits(module, params, tokens)
    loss, correct = train.token_cross_entropy(logits, tokens[:, 1:], mask)
    return loss, dict(tokens=jnp.sum(mask), correct=correct)
  return loss_fn


def joint_causal_lm_loss_fn(configs: Dict[str, DecoderOnlyConfig]) -> train.LossFn:
  """Several models on the same batches, params = {name: params}: the sum of their
  losses, so each model's gradient is exactly its own (as `train.joint_seq2seq_loss_fn`)."""
  if not configs:
    raise ValueError("joint_causal_lm_loss_fn needs at least one model config")
  loss_fns = {name: causal_lm_loss_fn(config) for name, config in configs.items()}

  def loss_fn(params, batch):
    total, aux = 0.0, {}
    for name, fn in loss_fns.items():
      loss, model_aux = fn(params[name], batch)
      total = total + loss
      aux[f"{name}/loss"] = loss
      aux[f"{name}/correct"] = model_aux["correct"]
      aux["tokens"] = model_aux["tokens"]
    return total, aux
  return loss_fn


def causal_distill_loss_fn(draft_configs: Dict[str, DecoderOnlyConfig], divergence: str,
                           temperature: float, topk: int = 0, topp: float = 0.0
                           ) -> train.LossFn:
  """Drafts {name: config} matched to the target's `teacher_probs` in the batch.

  Aux holds '{name}/loss' (the summed divergence), '{name}/correct' (draft
  argmax == teacher argmax: greedy agreement) and 'tokens'.
  """
  if divergence not in DIVERGENCES:
    raise ValueError(f"unknown divergence {divergence!r}; use one of {DIVERGENCES}")
  if temperature < sampling.MIN_TEMPERATURE:
    raise ValueError("distill at temperature > 0; use distill.distill_temperature(t) for "
                     "greedy decoding")
  modules = {name: DecoderOnly(config) for name, config in draft_configs.items()}

  def loss_fn(params, batch):
    mask = batch["weights"][:, 1:].astype(jnp.float32)
    teacher = batch["teacher_probs"]
    total, aux = 0.0, dict(tokens=jnp.sum(mask))
    for name, module in modules.items():
      logits = _next_token_logits(module, params[name], batch["tokens"])
      loss = divergence_sum(teacher, logits, mask, divergence, temperature, topk, topp)
      agree = (jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32)
      aux[f"{name}/loss"] = loss
      aux[f"{name}/correct"] = jnp.sum(agree * mask)
      total = total + loss
    return total, aux
  return loss_fn


def causal_teacher_probs(target: DecoderOnlyModel, tokens, temperature: float, topk: int = 0,
                         topp: float = 0.0) -> Array:
  """The target's adjusted distributions [batch, T - 1, vocab] for tokens 1..T-1."""
  tokens = jnp.asarray(tokens, jnp.int32)
  logits = target.logits(tokens[:, :-1])
  return sampling.adjust_probs(logits, temperature, topk, topp)


# ----------------------------------------------------------------------------
# Distillation driver: target continuations -> teacher probs -> drafts, with
# alpha measured before and after (the decoder-only `distill.distill_drafts`).

def _batches(n: int, batch_size: int):
  for start in range(0, n, batch_size):
    yield start, min(start + batch_size, n)


def _padded(array: np.ndarray, batch_size: int) -> np.ndarray:
  """array [k <= batch_size, ...] padded with copies of its first row (one compile)."""
  return np.concatenate([array, np.repeat(array[:1], batch_size - len(array), 0)])


def generate_continuations(model: DecoderOnlyModel, prompts, prompt_lengths, *,
                           max_decode_steps: int, temperature: float = 0.0, seed: int = 0,
                           batch_size: int = 64) -> Dict[str, np.ndarray]:
  """`model`'s continuations of right-padded prompts as a causal-LM batch.

  Returns `lm_batch` arrays over rows prompt[:L] + continuation (right-padded
  to P + max_decode_steps, the continuation cut after EOS), learning only the
  continuation. Batches use keys fold_in(PRNGKey(seed), batch index).
  """
  from specdec_jax.decoder_only_generation import decoder_only_generate
  prompts = np.asarray(prompts, np.int32)
  prompt_lengths = np.asarray(prompt_lengths, np.int32)
  n, width = prompts.shape
  rows = np.zeros((n, width + max_decode_steps), np.int32)
  lengths = np.zeros((n,), np.int32)
  for b, (start, end) in enumerate(_batches(n, batch_size)):
    out = decoder_only_generate(
        model, _padded(prompts[start:end], batch_size),
        _padded(prompt_lengths[start:end], batch_size), max_decode_steps=max_decode_steps,
        temperature=temperature, rng=jax.random.fold_in(jax.random.PRNGKey(seed), b))
    new = np.asarray(out.sequences)[:end - start]
    new_lengths = np.asarray(out.lengths)[:end - start]
    for i in range(end - start):
      length = prompt_lengths[start + i]
      rows[start + i, :length] = prompts[start + i, :length]
      rows[start + i, length:length + new_lengths[i]] = new[i, :new_lengths[i]]
      lengths[start + i] = length + new_lengths[i]
  return lm_batch(rows, lengths, prompt_lengths)


def measure_alpha(target: DecoderOnlyModel, draft, prompts, prompt_lengths, *,
                  max_decode_steps: int, temperature: float = 0.0, gamma: int = 4,
                  seed: int = 0, batch_size: int = 32) -> float:
  """alpha (Corollary 3.6) of `draft` against `target`, pooled over all prompts."""
  from specdec_jax.decoder_only_generation import decoder_only_generate
  prompts = np.asarray(prompts, np.int32)
  prompt_lengths = np.asarray(prompt_lengths, np.int32)
  beta_sum = beta_count = 0.0
  for b, (start, end) in enumerate(_batches(len(prompts), batch_size)):
    out = decoder_only_generate(
        target, prompts[start:end], prompt_lengths[start:end], max_decode_steps=max_decode_steps,
        temperature=temperature, draft=draft, gamma=gamma,
        rng=jax.random.fold_in(jax.random.PRNGKey(seed), b))
    beta_sum += float(out.stats.beta_sum.sum())
    beta_count += float(out.stats.beta_count.sum())
  return beta_sum / max(beta_count, 1.0)


def distill_decoder_only_drafts(target: DecoderOnlyModel, drafts: Dict[str, DecoderOnlyModel],
                                prompts, prompt_lengths, *, steps: int, batch_size: int = 16,
                                learning_rate: float = 3e-3, optimizer: str = "adamw",
                                divergence: str = "tv", temperature: float = 0.0,
                                topk: int = 0, topp: float = 0.0, max_decode_steps: int = 16,
                                seed: int = 0, eval_prompts=None, eval_prompt_lengths=None,
                                gamma: int = 4) -> Dict[str, object]:
  """Distils each draft towards `target` on the target's continuations of `prompts`.

  The target continues every prompt once (at the decode `temperature`); each
  step takes a batch of those rows, the target's adjusted distributions on
  them (at `distill.distill_temperature(temperature)`), and one optimizer
  update of every draft on the summed divergence (drafts are independent).

  Returns:
    dict(drafts={name: DecoderOnlyModel}, alpha_before / alpha_after
    ({name: alpha} at `temperature` on the eval prompts, when given),
    loss_first / loss_last: mean divergence per token at the first and last step).
  """
  from specdec_jax.train.distill import distill_temperature
  if not drafts:
    raise ValueError("distill_decoder_only_drafts needs at least one draft")
  for name, draft in drafts.items():
    if draft.config.vocab_size != target.config.vocab_size:
      raise ValueError(f"draft {name!r} has vocabulary {draft.config.vocab_size}, the target "
                       f"{target.config.vocab_size}")
  t_distill = distill_temperature(temperature)
  data = generate_continuations(target, prompts, prompt_lengths,
                                max_decode_steps=max_decode_steps, temperature=temperature,
                                seed=seed)
  loss_fn = causal_distill_loss_fn({n: d.config for n, d in drafts.items()}, divergence,
                                   t_distill, topk, topp)
  opt = train.make_optimizer(optimizer, learning_rate)
  state = train.create_train_state({n: d.params for n, d in drafts.items()}, opt)
  step_fn = jax.jit(lambda s, b: train.train_step(s, b, loss_fn=loss_fn, optimizer=opt))

  def alphas(models):
    if eval_prompts is None:
      return {}
    return {name: measure_alpha(target, m, eval_prompts, eval_prompt_lengths,
                                max_decode_steps=max_decode_steps, temperature=temperature,
                                gamma=gamma, seed=seed) for name, m in models.items()}

  alpha_before = alphas(drafts)
  order = np.random.default_rng(seed).permutation(len(data["tokens"]))
  losses = []
  for step in range(steps):
    rows = order[np.arange(step * batch_size, (step + 1) * batch_size) % len(order)]
    batch = {k: v[rows] for k, v in data.items()}
    batch["teacher_probs"] = causal_teacher_probs(target, batch["tokens"], t_distill, topk, topp)
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics["loss"]))
  distilled = {name: DecoderOnlyModel(d.config, state.params[name]) for name, d in drafts.items()}
  return dict(drafts=distilled, alpha_before=alpha_before, alpha_after=alphas(distilled),
              loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None)
