"""Training a PARD drafter (`drafts.ParallelDraft`) with the trainer: the PARD objective
distilled from the target.

A PARD drafter is a small model of the target's family that drafts K tokens
in one call over [x_0 .. x_t, m, ..., m] (K - 1 copies of the mask token m):
its logits at x_t's slot and at the masks' slots are q_1..q_K, the laws of the
tokens at t+1 .. t+K (`drafts.pard`). PARD (arXiv 2504.18583) teaches those
positions with a mask-token span; here each slot learns the target's own
teacher-forced law there (distillation, as `train.distill` does for a model
draft's single next token):

    loss = sum_j decay**j * sum_anchors w_{t+j} CE(softmax(target logits at t+j),
                                                  drafter logits at slot t+j)

for j = 0..K-1, with the batch's weights w (w_j = 1 where the prediction made at
j is data); anchors t are drawn per row (`train.dflash.block_anchors`: w_t > 0,
t + K - 1 < T). Slot j = 0 is the ordinary next-token prediction (the
drafter keeps its autoregressive skill), the mask slots learn the tokens
beyond it from the context alone.

How the call stays the decode-time one ('cache', where the family's block
callback can be differentiated: decoder-only): per row the drafter's cache
is built once over the whole teacher-forced row (`Family.start` with the row
as the prompt; a family whose decoder starts from a start token, T5:
`Family.start` on the encoder inputs, then one block of the decoder's inputs
at position 0); each anchor takes a copy and runs one block
[x_t, m x (K - 1)] at position t through the family's block callback, which
overwrites positions t..t+K-1 before anything reads them (causal attention
reads keys at or before its own position): the cache invariant
`ParallelDraft.block_laws` relies on. Where the block callback cannot be
differentiated (T5's fused decode softmax, a `lax.reduce` without a
derivative rule), each anchor's row [x_0..x_t, m, m, ...] runs through the
family's teacher-forced forward instead (`Family.token_logits`, 'forward'):
the same function, computed without a cache. Either way the logits are
`block_laws`' (tests/test_train_parallel_drafts.py checks both methods, both
families), and every param of the drafter model trains, its context keys
included.

Usage:

    batch = pard_batch(target, rows)                    # the target's logits (teacher)
    batch['anchors'] = block_anchors(batch['weights'], 16, draft.num_positions, seed=step)
    state = trainer.create_train_state(draft.params, optimizer)
    state, metrics = trainer.train_step(state, batch, loss_fn=pard_loss_fn(draft), ...)
"""

import functools
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.base import call_block
from specdec_jax.families.registry import family_of
from specdec_jax.train.dflash import block_anchors, block_loss, teacher_slots  # noqa: F401

Array = jax.Array


@functools.lru_cache(maxsize=None)
def _teacher_program(family, config):
  head = family.feature_head(config)

  def teacher(params, batch):
    out = family.teacher_features(config, params, batch)
    logits = head.logits(None, head.target_refs(params),
                         out["features"].astype(config.dtype)).astype(jnp.float32)
    return dict(tokens=out["tokens"], weights=out["weights"], teacher_logits=logits)
  return jax.jit(teacher)


def pard_batch(target, rows: Dict[str, np.ndarray]) -> Dict[str, Array]:
  """The loss's batch from a family training batch and the frozen target (one
  teacher-forced target pass, `Family.teacher_features` then its LM head).

  Returns {'tokens' [batch, T] int32: the decoder's inputs (decoder-only: the rows;
  T5: the start token, then targets[:-1]); 'weights' [batch, T] float32;
  'teacher_logits' [batch, T, vocab] float32: the target's logits of the token after
  each position} and, for a family whose drafter reads an encoder (T5), the rows'
  'inputs'.
  """
  out = dict(_teacher_program(family_of(target), target.config)(target.params, dict(rows)))
  if "inputs" in rows:
    out["inputs"] = jnp.asarray(rows["inputs"], jnp.int32)
  return out


METHODS = ("auto", "cache", "forward")


def pard_block_logits(draft, params, batch, anchors: Array, method: str = "auto") -> Array:
  """The drafter's logits [batch, A, K, vocab] float32 at each anchor t: its call over
  [x_0 .. x_t, m x (K - 1)] (the row's decoder inputs up to t, then the masks), slots
  t..t+K-1, as `ParallelDraft.block_laws` computes them when x_t is the last accepted
  token.

  params: the drafter model's params; batch: `pard_batch`'s ('tokens', T5: 'inputs');
  anchors [batch, A] int32 (t + K - 1 < T). method: 'cache' (the decode-time program:
  the row's cache built once, one block per anchor through the family's block
  callback), 'forward' (a teacher-forced forward of each anchor's row through
  `Family.token_logits`: the same function, for families whose block callback cannot be
  differentiated, e.g. T5's fused decode softmax) or 'auto' ('cache' where the block
  callback differentiates, else 'forward').
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if method == "auto":
    method = "cache" if _block_differentiates(draft.family, draft.model.config) else "forward"
  fn = _cache_logits if method == "cache" else _forward_logits
  logits = fn(draft, params, batch, anchors).astype(jnp.float32)
  if draft.padding:
    logits = jnp.pad(logits, ((0, 0), (0, 0), (0, 0), (0, draft.padding)),
                     constant_values=-jnp.inf)
  return logits


def _anchor_rows(draft, tokens: Array, anchors: Array) -> Array:
  """Each anchor's row [batch * A, T]: the decoder inputs up to t, then the mask token (a
  causal model's logits at t..t+K-1 see [x_0..x_t, m x (K - 1)]; later masks are never
  read by them)."""
  a = anchors.shape[1]
  rows = jnp.repeat(tokens, a, axis=0)
  at = anchors.reshape(-1)[:, None]
  return jnp.where(jnp.arange(tokens.shape[1])[None] <= at, rows, draft.mask_token_id)


def _read_slots(logits: Array, anchors: Array, k: int) -> Array:
  """logits [batch * A, T, V] -> [batch, A, K, V] at slots t..t+K-1."""
  b, a = anchors.shape
  read = anchors.reshape(b * a)[:, None] + jnp.arange(k)[None]
  return jnp.take_along_axis(logits, read[:, :, None], axis=1).reshape(b, a, k, -1)


def _forward_logits(draft, params, batch, anchors):
  family, config = draft.family, draft.model.config
  tokens = jnp.asarray(batch["tokens"], jnp.int32)
  rows = _anchor_rows(draft, tokens, anchors)
  if family.context(None, None).continued:
    # {'tokens', 'weights'}: logits at j read the tokens 0..j (one more column: T logits).
    pad = jnp.full((rows.shape[0], 1), draft.mask_token_id, jnp.int32)
    family_batch = dict(tokens=jnp.concatenate([rows, pad], axis=1),
                        weights=jnp.ones((rows.shape[0], rows.shape[1] + 1), jnp.float32))
  else:
    # {'inputs', 'targets'}: the decoder reads the start token, then targets[:-1] (rows[0]
    # is the start token), so targets are the rows shifted left.
    pad = jnp.full((rows.shape[0], 1), draft.mask_token_id, jnp.int32)
    family_batch = dict(inputs=jnp.repeat(jnp.asarray(batch["inputs"], jnp.int32),
                                          anchors.shape[1], axis=0),
                        targets=jnp.concatenate([rows[:, 1:], pad], axis=1))
  logits, _, _ = family.token_logits(config, params, family_batch)
  return _read_slots(logits, anchors, draft.num_positions)


def _cache_logits(draft, params, batch, anchors):
  family, config = draft.family, draft.model.config
  k = draft.num_positions
  tokens = jnp.asarray(batch["tokens"], jnp.int32)
  b, t = tokens.shape
  a = anchors.shape[1]
  block_fn = family.block_fn(config, params)
  if family.context(None, None).continued:
    # The row is the prompt: its keys at positions 0..T-1 (room for the last block).
    start = family.start(config, params, tokens, jnp.full((b,), t, jnp.int32), k + 1)
    cache = start.cache
  else:
    inputs = jnp.asarray(batch["inputs"], jnp.int32)
    lengths = jnp.sum(inputs != config.pad_id, axis=1).astype(jnp.int32)
    start = family.start(config, params, inputs, lengths, t + k)
    _, cache = call_block(block_fn, tokens, jnp.zeros((b,), jnp.int32), start.cache)
  cache = jax.tree_util.tree_map(lambda x: jnp.repeat(x, a, axis=0), cache)
  at = anchors.reshape(b * a)
  last = tokens[jnp.arange(b)[:, None], anchors].reshape(b * a, 1)
  block = jnp.concatenate([last, jnp.full((b * a, k - 1), draft.mask_token_id, jnp.int32)],
                          axis=1)
  logits, _ = call_block(block_fn, block, at, cache)
  return logits.reshape(b, a, k, -1)


@functools.lru_cache(maxsize=None)
def _block_differentiates(family, config) -> bool:
  """Whether the family's block callback can be differentiated (traced on a tiny batch,
  nothing runs)."""
  def probe(params):
    draft = _Shape(family, config)
    batch = dict(tokens=jnp.zeros((1, 3), jnp.int32), inputs=jnp.ones((1, 3), jnp.int32))
    return jnp.sum(_cache_logits(draft, params, batch, jnp.zeros((1, 1), jnp.int32)))
  try:
    jax.eval_shape(jax.grad(probe), family.abstract_params(config))
    return True
  except TypeError:
    return False


class _Shape:
  """What `_cache_logits` reads of a ParallelDraft (the probe's stand-in)."""

  def __init__(self, family, config):
    self.family, self.mask_token_id, self.num_positions = family, 0, 2
    self.model = type("Model", (), {"config": config})()


def pard_loss_fn(draft, decay: float = 0.8, method: str = "auto"):
  """The PARD loss of the drafter model's params on `pard_batch`es with 'anchors' (the
  trainer's LossFn).

  method: how the block's logits are computed (`pard_block_logits`).
  Returns:
    fn(params, batch) -> (summed loss, aux): tokens (valid anchors), cross_entropy_i /
    correct_i / positions_i (sums) for slot i = 1..K (slot 1: x_t's, the next token),
    correct = correct_1 (`train.medusa.per_head_accuracy` reads them).
  """
  if not decay >= 0.0:
    raise ValueError(f"decay must be >= 0, got {decay}")
  if draft.padding:
    raise ValueError("pard_loss_fn trains a drafter of the target's own vocabulary size "
                     "(target_vocab_size pads it with -inf: no soft cross-entropy there)")
  k = draft.num_positions

  def fn(params, batch):
    if "anchors" not in batch:
      raise ValueError("the PARD loss needs batch['anchors'] [batch, A] (see block_anchors)")
    anchors = jnp.asarray(batch["anchors"], jnp.int32)
    weights = jnp.asarray(batch["weights"], jnp.float32)
    logits = pard_block_logits(draft, params, batch, anchors, method)      # [b, A, K, V]
    teacher, valid = teacher_slots(jnp.asarray(batch["teacher_logits"], jnp.float32),
                                   weights, anchors, k)
    return block_loss(logits, jax.lax.stop_gradient(teacher), valid, decay)

  return fn
