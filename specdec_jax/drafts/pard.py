"""PARD (AMD, arXiv 2504.18583): a small model that drafts K tokens in one forward.

A PARD drafter is an ordinary model of the target's vocabulary (any family:
a decoder-only LM, or a T5 draft's decoder) trained so that one call over

    [..., x_t, m, m, ..., m]        (K - 1 copies of one mask token m)

predicts x_{t+1} at x_t's slot and x_{t+1+i} at the i-th mask's slot: the
laws q_1..q_K of the next K positions, each a function of the accepted tokens
alone (the masks carry no draft token), from one call (`drafts.parallel`).

The draft's own cache. The call writes keys and values for every slot it
feeds, the masks' too, at the positions after the row's last token. Those are
not the tokens that end up there, so the next call feeds again, before its
masks, every position since the last token it fed as real: at most `window`
(the target's block width bounds what a row gains per iteration), starting
at max(lengths - window + 1, 0). Positions before that hold real tokens, fed
by an earlier call; positions from there on are overwritten before any query
reads them (causal attention reads keys at or before its own position). So
the call's block is window + K - 1 slots:

    slot s < r                  the row's token at start + s  (r = lengths - start + 1)
    r <= s < r + K - 1          the mask token
    later                       padding (written past the masks, never read)

and q_i is read at slot r - 1 + (i - 1). Nothing here depends on drafted
tokens, so exactness never rests on the cache: a stale entry could only
change q, and the token is always drawn from the q that verification reads.

Public PARD checkpoints are ordinary HF causal LMs whose config.json names the
mask token (`pard_token`); `sj.load_parallel_draft` reads one.
"""

from typing import Any, Hashable, Optional

import jax.numpy as jnp

from specdec_jax.drafts.model_draft import ModelDraft
from specdec_jax.drafts.parallel import ParallelDrafter
from specdec_jax.families.base import call_block, shift_block_fn


class ParallelDraft(ParallelDrafter):
  """A PARD-style parallel drafter: one call over the context plus K - 1 mask tokens.

  Args:
    model: the drafter, a model of the target's family and vocabulary (a
      decoder-only LM; for T5 targets a T5 model, whose decoder takes the masks).
    mask_token_id: the id the drafter was trained with as its mask (PARD's
      `pard_token`); an id of its vocabulary.
    gamma: K, the most tokens one call drafts (the longest chain; the deepest
      tree). A decode's own gamma may be smaller.
    target_vocab_size: as `ModelDraft`'s: the drafter's logits padded with -inf
      up to the target's vocabulary (one tokenizer, tables of other sizes).
  """

  def __init__(self, model, mask_token_id: int, gamma: int = 4,
               target_vocab_size: Optional[int] = None):
    # The model's own checks, state and shardings are a model draft's: delegated.
    self.model_draft = ModelDraft(model, target_vocab_size=target_vocab_size)
    self.family = self.model_draft.family
    own = model.config.vocab_size
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
      raise ValueError(f"gamma must be an int >= 1 (tokens one call drafts), got {gamma!r}")
    if (mask_token_id is None or isinstance(mask_token_id, bool) or
        int(mask_token_id) != mask_token_id or not 0 <= mask_token_id < own):
      raise ValueError(f"mask_token_id must be an id of the drafter's vocabulary [0, {own}), "
                       f"got {mask_token_id!r}: PARD checkpoints name it `pard_token` in "
                       "config.json (sj.load_parallel_draft reads it)")
    self.model = model
    self.mask_token_id = int(mask_token_id)
    self.gamma = int(gamma)
    self.padding = self.model_draft.padding
    self.vocab_size = self.model_draft.vocab_size
    self.eos_id = model.config.eos_id
    self.pad_id = model.config.pad_id

  @property
  def num_positions(self) -> int:
    return self.gamma

  @property
  def params(self) -> Any:
    return self.model.params

  def static_key(self) -> Hashable:
    return ("parallel", self.model_draft.compile_key(), self.mask_token_id, self.gamma)

  def check_compatible(self, target_config) -> None:
    if not self.padding and self.vocab_size < target_config.vocab_size:
      raise ValueError(f"the drafter's vocabulary size {self.vocab_size} is smaller than the "
                       f"target's {target_config.vocab_size}: if its ids are the target's "
                       "first ones (one tokenizer, tables padded to different sizes), build "
                       f"it with sj.ParallelDraft(model, mask_token_id=..., "
                       f"target_vocab_size={target_config.vocab_size})")
    self.model_draft.check_compatible(target_config)

  def check_inputs(self, tokens, lengths, max_decode_steps: int) -> None:
    self.model_draft.check_inputs(tokens, lengths, max_decode_steps)

  def room(self, block_width: int) -> int:
    # A call writes up to window + K - 1 slots from max(lengths - window + 1, 0); a
    # tree's pending tokens widen the window by up to the block width.
    return 2 * block_width + self.gamma

  def param_shardings(self, partitioner):
    return self.model_draft.param_shardings(partitioner)

  def constrain_state(self, state, partitioner):
    return self.model_draft.constrain_state(state, partitioner)

  def init_state(self, params, start):
    """dict(cache: the drafter's cache with the context in it, offset [batch] int32)."""
    return self.model_draft.init_state(params, start)

  def block_laws(self, params, state, sequences, lengths, num, window):
    batch = sequences.shape[0]
    rows = jnp.arange(batch)[:, None]
    width = window + num - 1
    first = jnp.maximum(lengths - window + 1, 0)               # [batch]
    real = (lengths - first + 1)[:, None]                      # [batch, 1]: r
    slot = jnp.arange(width)[None]                             # [1, width]
    at = jnp.clip(first[:, None] + slot, 0, sequences.shape[1] - 1)
    tokens = jnp.where(slot < real, sequences[rows, at],
                       jnp.where(slot < real + num - 1, self.mask_token_id, self.pad_id))
    block = shift_block_fn(self.model_draft.block_fn(params), state["offset"])
    logits, cache = call_block(block, tokens.astype(jnp.int32), first, state["cache"])
    read = real - 1 + jnp.arange(num)[None]                    # [batch, num]
    logits = jnp.take_along_axis(logits, read[:, :, None], axis=1).astype(jnp.float32)
    return logits, jnp.ones((batch,), jnp.bool_), dict(state, cache=cache)
