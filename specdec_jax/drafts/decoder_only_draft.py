"""`DecoderOnlyModelDraft`: a smaller decoder-only model as a draft.

The decoder-only counterpart of `ModelDraft`. Under `decoder_only_generate`
every draft's `init_state` receives the prompts as `encoder_tokens` [batch, P]
with padding positions set to `decoder_only_model.PROMPT_PADDING` (-1), so
this draft recovers each row's prompt length, prefills its own cache with the
prompt, and drafts at the same loop positions as the target (loop position j
= absolute position prompt_length - 1 + j).
"""

from typing import Any, Hashable, Optional

import jax

from specdec_jax.core import decoding
from specdec_jax.families.decoder_only.model import (DecoderOnlyModel, absolute_block_fn,
                                            decode_cache_length, prefilled_cache,
                                            shift_block_fn, split_marked_prompts)
from specdec_jax.drafts.base import Draft
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig

Array = jax.Array


class DecoderOnlyModelDraft(Draft):
  """Drafts with a `DecoderOnlyModel`, optionally stopping early when unsure.

  Args:
    model: the draft network; it must share the target's vocabulary.
    confidence_threshold: stop a row's drafting once the draft's top
      probability falls below this (see `decoding.model_propose_fn`).
  """

  def __init__(self, model: DecoderOnlyModel, confidence_threshold: Optional[float] = None):
    if not isinstance(model, DecoderOnlyModel):
      raise TypeError(f"DecoderOnlyModelDraft takes a DecoderOnlyModel, got "
                      f"{type(model).__name__}")
    if confidence_threshold is not None and not 0.0 < confidence_threshold <= 1.0:
      raise ValueError(f"confidence_threshold must lie in (0, 1], got {confidence_threshold!r}")
    self.model = model
    self.confidence_threshold = confidence_threshold
    self.vocab_size = model.config.vocab_size
    self.eos_id = model.config.eos_id
    self.pad_id = model.config.pad_id

  @property
  def params(self) -> Any:
    return self.model.params

  def static_key(self) -> Hashable:
    return ("decoder_only_model", self.model.config, self.confidence_threshold)

  def check_compatible(self, target_config) -> None:
    if not isinstance(target_config, DecoderOnlyConfig):
      raise ValueError(f"a decoder-only draft cannot serve a {type(target_config).__name__} "
                       f"target: the model families differ")
    if self.vocab_size != target_config.vocab_size:
      raise ValueError(f"draft vocabulary size {self.vocab_size} differs from the target's "
                       f"{target_config.vocab_size}: speculative decoding needs one vocabulary")

  def init_state(self, params, encoder_tokens, max_decode_len):
    """encoder_tokens: the prompts [batch, P], padding = PROMPT_PADDING -> the
    draft's prefilled cache and the rows' prompt lengths."""
    prompts, lengths = split_marked_prompts(encoder_tokens)
    cache = prefilled_cache(self.model.config, params, prompts, lengths,
                            decode_cache_length(prompts.shape[1], max_decode_len))
    return dict(cache=cache, prompt_lengths=lengths)

  def propose_fn(self, params, gamma, temperature, topk, topp):
    block = absolute_block_fn(self.model.config, params)

    def propose(rng, state, sequences, lengths, max_drafted=None):
      inner = decoding.model_propose_fn(shift_block_fn(block, state["prompt_lengths"]), gamma,
                                        temperature, topk, topp, self.confidence_threshold)
      tokens, probs, num_drafted, cache = inner(rng, state["cache"], sequences, lengths,
                                                max_drafted)
      return tokens, probs, num_drafted, dict(state, cache=cache)

    return propose
