"""A smaller T5 as the draft (the paper's setting)."""

from typing import Any, Hashable

from specdec_jax import decoding
from specdec_jax.drafts.base import Draft
from specdec_jax.models.t5 import T5


class ModelDraft(Draft):
  """Drafts with a T5 `Model` that runs its own encoder on the same inputs."""

  def __init__(self, model):
    self.model = model
    self.vocab_size = model.config.vocab_size
    self.eos_id = model.config.eos_id
    self.pad_id = model.config.pad_id

  @property
  def params(self) -> Any:
    return self.model.params

  def static_key(self) -> Hashable:
    return ("model", self.model.config)

  def init_state(self, params, encoder_tokens, max_decode_len):
    return self.model.module.apply({"params": params}, encoder_tokens, max_decode_len,
                                   method=T5.init_cache)

  def propose_fn(self, params, gamma, temperature, topk, topp):
    return decoding.model_propose_fn(self.model.block_fn(params), gamma, temperature, topk, topp)
