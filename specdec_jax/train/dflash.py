"""Training a DFlash drafter (`drafts.DFlashDraft`) with the trainer.

A DFlash drafter fills a block [x_t, m, ..., m] (the row's last token x_t at
position t, then K mask tokens) in one non-causal call over a context cache
of the target's tapped features at positions < t (`drafts.dflash`). Training
runs exactly that call, teacher-forced, at anchors t drawn per row:

    context    `DFlashDraft.context_key_values` of the target's features at
               every position of the row, computed once per row and shared by
               its anchors; anchor t sees the positions < t (the visible mask:
               what `observe` has put in the cache when x_t is the last
               accepted token), T5 also the encoder outputs
               (`cross_key_values` of the memory)
    block      `DFlashDraft.block_hidden` over [x_t, m x K] at positions
               t..t+K, then `DFlashDraft.logits` at slots 1..K
    teacher    slot i's law is the target's own teacher-forced law of the
               token at t + i: its LM head on its last-layer feature at
               t + i - 1 (as `train.medusa` distills), a constant

    loss = sum_i decay**(i-1) * sum_anchors w_{t+i-1} CE(softmax(teacher_{t+i}),
                                                       slot_i logits)

with the batch's weights w (w_j = 1 where the prediction made at j is data,
as `train.medusa` reads them); an anchor is a position with w_t > 0 and
t + K - 1 < T (every slot's teacher inside the row). The batch's per-token
scale (aux 'tokens') is the anchors' count, so the loss per token is the
summed CE of one block.

The function trained is the function that drafts: the loss calls the
drafter's own `context_key_values`, `cross_key_values`, `block_hidden` and
`logits` (tests/test_train_parallel_drafts.py checks it equals
`DFlashDraft.block_laws` after `init_state` / `observe`).

Usage (the feature heads' trainer and data):

    batch = dflash_batch(draft, target, rows)           # the target's tapped features
    batch['anchors'] = block_anchors(batch['weights'], 16, draft.num_positions, seed=step)
    state = trainer.create_train_state(draft.head_params, optimizer)
    state, metrics = trainer.train_step(state, batch, loss_fn=dflash_loss_fn(draft), ...)
"""

import functools
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.registry import family_of
from specdec_jax.train.feature_heads import draw_anchors, soft_cross_entropy

Array = jax.Array


def _last_layer(config) -> int:
  """The hidden-state index of a config's last layer after its final norm (the features
  its LM head reads; `families.feature_head.feature_taps`' None)."""
  return int(getattr(config, "num_layers", None) or config.num_decoder_layers)


@functools.lru_cache(maxsize=None)
def _teacher_program(family, config, layers):
  return jax.jit(functools.partial(family.teacher_features, config, layers=layers))


def dflash_batch(draft, target, rows: Dict[str, np.ndarray]) -> Dict[str, Array]:
  """The loss's batch from a family training batch (`Family.teacher_features`' input) and
  the frozen target: one teacher-forced target pass for the drafter's taps and the last
  layer.

  Returns {'tokens' [batch, T] int32 (the decoder's inputs), 'features' [batch, T, f]
  float32 (the target's features at the drafter's taps, position j: the state of token
  j), 'last' [batch, T, emb] float32 (its last-layer features: `last[j]` gives the law
  of token j + 1), 'weights' [batch, T] float32} and, for T5, 'memory' (the encoder
  outputs and mask).
  """
  config = target.config
  taps = tuple(int(i) for i in draft.config.taps)
  out = dict(_teacher_program(family_of(target), config, taps + (_last_layer(config),))(
      target.params, dict(rows)))
  features = out.pop("features")
  width = draft.feature_dim
  out["features"], out["last"] = features[..., :width], features[..., width:]
  if out.get("memory") is None:
    out.pop("memory", None)
  return out


def block_anchors(weights, num_anchors: int, num_positions: int, seed: int) -> np.ndarray:
  """Anchor positions [batch, num_anchors] int32: per row, `num_anchors` distinct positions
  t drawn uniformly (seeded) among those with weight > 0 and t + num_positions - 1 < T
  (every slot of the block learns a position of the row); rows with fewer repeat them, a
  row with none gets zeros (masked by the loss). A pure function of its arguments."""
  weights = np.asarray(weights)
  if num_anchors < 1:
    raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
  if num_positions < 1:
    raise ValueError(f"num_positions must be >= 1, got {num_positions}")
  t = weights.shape[1]
  return draw_anchors(weights[:, :max(t - num_positions + 1, 0)], num_anchors, seed, stream=37)


def teacher_slots(teacher: Array, weights: Array, anchors: Array, num_positions: int):
  """Per anchor and slot i = 1..K the teacher's row at t + i - 1 and its weight.

  teacher [batch, T, ...] (the target's logits, or anything aligned with the prediction
  made at each position), weights [batch, T], anchors [batch, A] -> (teacher [batch, A,
  K, ...], valid [batch, A, K] float32: w_{t+i-1}, 0 past the row, and 0 for a whole
  block whose anchor has w_t = 0)."""
  b, t = weights.shape
  at = anchors[:, :, None] + jnp.arange(num_positions)[None, None]      # [b, A, K]
  inside = at < t
  at = jnp.minimum(at, t - 1)
  rows = jnp.arange(b)[:, None, None]
  valid = inside * weights[rows, at] * (weights[jnp.arange(b)[:, None], anchors] > 0)[..., None]
  return teacher[rows, at], valid.astype(jnp.float32)


def dflash_block_logits(draft, params, batch, anchors: Array) -> Array:
  """The drafter's logits [batch, A, K, vocab] float32 of the block at each anchor: what
  `DFlashDraft.block_laws` computes when x_t (tokens[t]) is the row's last accepted token
  and the context cache holds the target's features at positions < t.

  params: the draft's `params` (dict(draft=head params, target=refs)); batch:
  `dflash_batch`'s ('tokens', 'features', and for T5 'memory'); anchors [batch, A] int32.
  """
  c, own = draft.config, params["draft"]
  tokens = jnp.asarray(batch["tokens"], jnp.int32)
  b, t = tokens.shape
  a = anchors.shape[1]
  k = draft.num_positions
  positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
  # Once per row, shared by its anchors (repeated along the batch axis, not recomputed).
  keys, values = draft.context_key_values(own, batch["features"], positions)
  keys, values = jnp.repeat(keys, a, axis=1), jnp.repeat(values, a, axis=1)
  at = anchors.reshape(b * a)
  visible = jnp.arange(t)[None] < at[:, None]                            # [b * A, T]
  last = tokens[jnp.arange(b)[:, None], anchors].reshape(b * a, 1)
  block = jnp.concatenate([last, jnp.full((b * a, k), c.mask_token_id, jnp.int32)], axis=1)
  block_positions = at[:, None] + jnp.arange(k + 1)[None]
  cross = None
  if c.cross_attention:
    memory = batch["memory"]
    cross_keys, cross_values = draft.cross_key_values(own, memory["encoded"])
    cross = (jnp.repeat(cross_keys, a, axis=1), jnp.repeat(cross_values, a, axis=1),
             jnp.repeat(memory["encoder_mask"].astype(bool), a, axis=0))
  hidden = draft.block_hidden(params, block, block_positions, keys, values, visible, cross)
  return draft.logits(params, hidden[:, 1:]).reshape(b, a, k, -1)


def dflash_loss_fn(draft, decay: float = 0.8):
  """The DFlash loss of `draft`'s head params on `dflash_batch`es with 'anchors' (the
  trainer's LossFn; the target's embedding and LM head are constants of the step).

  Returns:
    fn(head_params, batch) -> (summed loss, aux): tokens (valid anchors: the per-token
    scale), cross_entropy_i / correct_i (slot i's argmax == the target's) / positions_i
    (sums) for i = 1..K, and correct = correct_1 (`train.medusa.per_head_accuracy`
    reads them).
  """
  if not decay >= 0.0:
    raise ValueError(f"decay must be >= 0, got {decay}")
  k = draft.num_positions
  refs = draft.target_refs
  target_head = family_of(draft.target_config).feature_head(draft.target_config)

  def fn(head_params, batch):
    if "anchors" not in batch:
      raise ValueError("the DFlash loss needs batch['anchors'] [batch, A] (see block_anchors)")
    params = dict(draft=head_params, target=refs)
    anchors = jnp.asarray(batch["anchors"], jnp.int32)
    weights = jnp.asarray(batch["weights"], jnp.float32)
    logits = dflash_block_logits(draft, params, batch, anchors)           # [b, A, K, V]
    last = jnp.asarray(batch["last"]).astype(draft.config.dtype)
    target_logits = jax.lax.stop_gradient(
        target_head.logits(None, refs, last).astype(jnp.float32))          # [b, T, V]
    teacher, valid = teacher_slots(target_logits, weights, anchors, k)
    return block_loss(logits, teacher, valid, decay)

  return fn


def block_loss(logits: Array, teacher: Array, valid: Array, decay: float):
  """The summed, decayed soft cross-entropy of block logits [b, A, K, V] against teacher
  logits [b, A, K, V] where valid [b, A, K] > 0, and its aux (see `dflash_loss_fn`)."""
  k = logits.shape[2]
  ce = soft_cross_entropy(teacher, logits)                                # [b, A, K]
  ce = jnp.where(valid > 0, ce, 0.0)  # a masked slot's logits never reach the sum
  correct = (jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)) * valid
  loss = 0.0
  aux: Dict[str, Array] = {}
  for i in range(1, k + 1):
    loss = loss + decay ** (i - 1) * jnp.sum(valid[:, :, i - 1] * ce[:, :, i - 1])
    aux[f"cross_entropy_{i}"] = jnp.sum(valid[:, :, i - 1] * ce[:, :, i - 1])
    aux[f"correct_{i}"] = jnp.sum(correct[:, :, i - 1])
    aux[f"positions_{i}"] = jnp.sum(valid[:, :, i - 1])
  aux["tokens"] = aux["positions_1"]
  aux["correct"] = aux["correct_1"]
  return loss, aux
