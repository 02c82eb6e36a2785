"""A smaller T5 as the draft (the paper's setting)."""

from typing import Any, Hashable, Optional

from specdec_jax.core import decoding
from specdec_jax.drafts.base import Draft
from specdec_jax.families.t5.network import T5


class ModelDraft(Draft):
  """Drafts with a T5 `Model` that runs its own encoder on the same inputs.

  Args:
    model: the draft `Model` (same vocabulary and EOS/pad ids as the target).
    confidence_threshold: optional, in (0, 1]: a row stops drafting when the
      draft's top probability for the next position falls below it (HF's
      `assistant_confidence_threshold`, DISCO-style), so at most gamma and at
      least one token are drafted per iteration. The probability is read from
      the draft's own softmax (temperature 1, no truncation), not from the
      adjusted q: under greedy decoding q is one-hot and would never stop.
      Only the *top* probability is compared (not the drawn token's), so the
      stopping rule is a function of the prefix alone and exactness is kept.
  """

  def __init__(self, model, confidence_threshold: Optional[float] = None):
    if confidence_threshold is not None and not 0.0 < float(confidence_threshold) <= 1.0:
      raise ValueError(f"confidence_threshold must lie in (0, 1], got {confidence_threshold!r}")
    self.model = model
    self.confidence_threshold = (None if confidence_threshold is None else
                                 float(confidence_threshold))
    self.vocab_size = model.config.vocab_size
    self.eos_id = model.config.eos_id
    self.pad_id = model.config.pad_id

  @property
  def params(self) -> Any:
    return self.model.params

  def static_key(self) -> Hashable:
    return ("model", self.model.config, self.confidence_threshold)

  def init_state(self, params, encoder_tokens, max_decode_len):
    return self.model.module.apply({"params": params}, encoder_tokens, max_decode_len,
                                   method=T5.init_cache)

  def propose_fn(self, params, gamma, temperature, topk, topp):
    return decoding.model_propose_fn(self.model.block_fn(params), gamma, temperature, topk, topp,
                                     confidence_threshold=self.confidence_threshold)
