"""Losses for training and distilling decoder-only models with `specdec_jax.train`.

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
TV = 1 - beta against the target's adjusted p), as for T5.
"""

from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import sampling
from specdec_jax import train
from specdec_jax.decoder_only_model import DecoderOnlyModel
from specdec_jax.distill import DIVERGENCES, divergence_sum
from specdec_jax.models.decoder_configs import DecoderOnlyConfig
from specdec_jax.models.decoder_only import DecoderOnly

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
