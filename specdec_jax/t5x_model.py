"""A T5X-style model whose `predict_batch` can decode speculatively.

`SpeculativeEncoderDecoderModel` mirrors the inference half of
`t5x.models.EncoderDecoderModel`: batches are dicts with
'encoder_input_tokens' [batch, enc_len] and 'decoder_input_tokens'
[batch, dec_len] (shifted right; dec_len is the decode length), params are
`{'target': target_params, 'draft': draft_params}`, and `decode_fn` is
swappable (by gin or by argument) between `decoding.temperature_sample`
(the plain T5X loop, the draft unused) and `decoding.speculative_sample`.

Like T5X it encodes once, allocates the cache, and hands the decode function a
logits callback; the loops themselves are `specdec_jax.decoding`'s, shared
with `specdec_jax.generate`, so both produce the same tokens from the same
rng.

`t5x` cannot be installed from PyPI (its package there is an empty
placeholder). When a source install of t5x is importable, the class
subclasses `t5x.models.EncoderDecoderModel`, so T5X's infer/eval loops can
drive it (that path is untested here); otherwise it stands alone.
"""

import functools
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import gin
import jax
import jax.numpy as jnp

from specdec_jax import decoding
from specdec_jax import sampling
from specdec_jax.drafts import Draft, ModelDraft
from specdec_jax.model import Model
from specdec_jax.models.configs import T5Config
from specdec_jax.models.t5 import T5



def alias_jestimator_partition_spec() -> None:
  """Lets T5X import on current jax.

  T5X imports `jestimator` (PyPI 0.3.3, 2022), whose `amos_helper` does
  `from jax.experimental.pjit import PartitionSpec`, gone from current jax.
  Setting the old name to `jax.sharding.PartitionSpec` before T5X is imported
  is all it needs (`experiments/t5x_demo/site/sitecustomize.py` does the same
  for `python -m t5x.infer`).
  """
  import jax.experimental.pjit as pjit_module
  if not hasattr(pjit_module, "PartitionSpec"):
    pjit_module.PartitionSpec = jax.sharding.PartitionSpec


try:  # A source install of T5X; never available from PyPI.
  alias_jestimator_partition_spec()
  from t5x import models as _t5x_models
  _BASE = _t5x_models.EncoderDecoderModel
except ImportError:  # pragma: no cover - depends on the environment
  _t5x_models = None
  _BASE = object

Array = jax.Array
PyTree = Any

# Compiled decoders shared by every model instance with the same static
# structure, so re-creating a model (one per experiment) never recompiles.
_COMPILED: Dict[Any, Callable[..., Any]] = {}

gin.external_configurable(decoding.temperature_sample, module="specdec_jax.decoding")
gin.external_configurable(decoding.speculative_sample, module="specdec_jax.decoding")


def _as_draft(draft: Union[None, Draft, T5Config, Model]) -> Optional[Draft]:
  """A `Draft` for the draft argument; a T5Config means a model draft of that shape."""
  if draft is None or isinstance(draft, Draft):
    return draft
  if isinstance(draft, T5Config):
    return ModelDraft(Model(draft, None))
  if isinstance(draft, Model):
    return ModelDraft(draft)
  raise TypeError(f"draft must be a Draft, Model or T5Config, got {type(draft).__name__}")


@gin.configurable
class SpeculativeEncoderDecoderModel(_BASE):
  """T5X `EncoderDecoderModel` inference API over a target and a draft.

  Args:
    target_config: the target network's `T5Config`.
    draft: the draft: a `T5Config` (a smaller T5 whose params are
      `params['draft']`), a `Model` or any `specdec_jax.drafts.Draft` (its
      arrays are `params['draft']`); None for plain decoding only.
    decode_fn: `decoding.temperature_sample` or `decoding.speculative_sample`.
    gamma: tokens drafted per iteration (speculative_sample).
    temperature / topk / topp: sampling settings, shared by target and draft.
      topk defaults to 0 (no truncation), unlike T5X's topk=1.
    input_vocabulary / output_vocabulary: passed to T5X's constructor when
      t5x is installed (ignored otherwise).
  """

  def __init__(self, target_config: T5Config,
               draft: Union[None, Draft, T5Config, Model] = None,
               decode_fn: Callable[..., Any] = decoding.temperature_sample,
               gamma: int = 4, temperature: float = 0.0, topk: int = 0, topp: float = 0.0,
               input_vocabulary=None, output_vocabulary=None):
    if decode_fn not in (decoding.temperature_sample, decoding.speculative_sample):
      raise ValueError("decode_fn must be decoding.temperature_sample or "
                       f"decoding.speculative_sample, got {decode_fn!r}")
    self.target_config = target_config
    self.draft = _as_draft(draft)
    if decode_fn is decoding.speculative_sample:
      if self.draft is None:
        raise ValueError("decode_fn=speculative_sample needs a draft")
      if int(gamma) != gamma or gamma < 1:
        raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
    if self.draft is not None:
      self.draft.check_compatible(target_config)
    sampling.validate_sampling(temperature, topk, topp, target_config.vocab_size)
    self._decode_fn = decode_fn
    self.gamma = int(gamma)
    self.temperature, self.topk, self.topp = float(temperature), int(topk), float(topp)
    self.module = T5(target_config)
    if _BASE is not object:  # pragma: no cover - needs a source install of t5x
      super().__init__(module=self.module, input_vocabulary=input_vocabulary,
                       output_vocabulary=output_vocabulary, optimizer_def=None,
                       decode_fn=decode_fn)

  @property
  def is_speculative(self) -> bool:
    return self._decode_fn is decoding.speculative_sample

  def _decode(self, params: Mapping[str, PyTree], encoder_tokens: Array,
              decoder_inputs: Array, rng: Array, num_decodes: int, max_decode_steps: int):
    """Traced body: encode + cache, then the decode loop. See predict_batch_with_aux."""
    batch, length = decoder_inputs.shape
    cache = self.module.apply({"params": params["target"]}, encoder_tokens, length,
                              method=T5.init_cache)
    target_fn = Model(self.target_config, params["target"]).block_fn(params["target"])
    common = dict(eos_id=self.target_config.eos_id, decode_rng=rng,
                  temperature=self.temperature, topk=self.topk, topp=self.topp,
                  max_decode_steps=max_decode_steps)
    if not self.is_speculative:
      decodes, log_prob = self._decode_fn(
          decoder_inputs, cache, decoding.block_to_state_fn(target_fn),
          num_decodes=num_decodes, **common)
      return decodes, {"scores": log_prob}
    draft_state = self.draft.init_state(params["draft"], encoder_tokens, length)
    propose = self.draft.propose_fn(params["draft"], self.gamma, self.temperature, self.topk,
                                    self.topp)
    decodes, stats = self._decode_fn(decoder_inputs, cache, target_fn, draft_state, None,
                                     gamma=self.gamma, propose_fn=propose, **common)
    return decodes, stats

  def predict_batch_with_aux(self, params: Mapping[str, PyTree], batch: Mapping[str, Array],
                             rng: Optional[Array] = None, decoder_params=None,
                             return_all_decodes: bool = False, num_decodes: int = 1,
                             prompt_with_targets: bool = False,
                             max_decode_steps: Optional[int] = None
                             ) -> Tuple[Array, Dict[str, Array]]:
    """Decodes a batch, T5X style.

    Args:
      params: `{'target': ..., 'draft': ...}` ('draft' unused by
        temperature_sample; may be absent then).
      batch: 'encoder_input_tokens' [batch, enc_len] int32 and
        'decoder_input_tokens' [batch, dec_len] int32 (only the shape is used:
        decoder prompts are not supported).
      rng: decode PRNG key (default PRNGKey(0)).
      decoder_params: must be None or empty (T5X passes extra decode_fn
        kwargs here; settings live on the model).
      return_all_decodes: temperature_sample only: return [batch,
        num_decodes, dec_len] instead of the most likely decode.
      num_decodes: samples per input (temperature_sample only; 1 otherwise).
      prompt_with_targets: unsupported (must be False).
      max_decode_steps: at most this many tokens (default dec_len).
    Returns:
      decodes [batch, dec_len] int32 (0 after EOS) and aux: {'scores':
      log_prob [batch]} for temperature_sample, the per-row speculative
      counters (see `decoding.init_stats`) for speculative_sample.
    """
    if decoder_params:
      raise ValueError("decoder_params are not supported: set sampling on the model")
    if prompt_with_targets:
      raise ValueError("prompt_with_targets is not supported")
    encoder_tokens = jnp.asarray(batch["encoder_input_tokens"], jnp.int32)
    decoder_inputs = jnp.asarray(batch["decoder_input_tokens"], jnp.int32)
    if encoder_tokens.ndim != 2 or decoder_inputs.ndim != 2:
      raise ValueError("encoder_input_tokens and decoder_input_tokens must be [batch, length]")
    if encoder_tokens.shape[0] != decoder_inputs.shape[0]:
      raise ValueError(f"batch mismatch: {encoder_tokens.shape[0]} encoder rows, "
                       f"{decoder_inputs.shape[0]} decoder rows")
    if self.is_speculative and num_decodes != 1:
      raise ValueError("speculative_sample draws one decode per input (num_decodes=1)")
    if "target" not in params or (self.is_speculative and "draft" not in params):
      raise ValueError("params must be {'target': ..., 'draft': ...}")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    key = (self.target_config, None if self.draft is None else self.draft.static_key(),
           self._decode_fn.__name__, self.gamma, self.temperature, self.topk, self.topp,
           int(num_decodes), max_decode_steps)
    if key not in _COMPILED:
      _COMPILED[key] = jax.jit(functools.partial(
          self._decode, num_decodes=int(num_decodes), max_decode_steps=max_decode_steps))
    decodes, aux = _COMPILED[key](dict(params), encoder_tokens, decoder_inputs, rng)
    if not self.is_speculative and not return_all_decodes:
      # T5X: decodes are sorted by increasing log-prob; keep the most likely.
      decodes, aux = decodes[:, -1], {"scores": aux["scores"][:, -1]}
    return decodes, aux

  def predict_batch(self, params: Mapping[str, PyTree], batch: Mapping[str, Array],
                    rng: Optional[Array] = None, **kwargs) -> Array:
    """`predict_batch_with_aux` without the aux: decodes [batch, dec_len]."""
    return self.predict_batch_with_aux(params, batch, rng=rng, **kwargs)[0]
