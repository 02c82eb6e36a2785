"""The T5 family: an encoder-decoder, behind the family contract (`families/base.py`).

A decode starts by encoding the inputs once: the cache holds the
cross-attention keys/values of the encoder output and room for the decoder's
self-attention. The decoder starts from `decoder_start_id` at position 0, so
loop positions are absolute positions (offset 0). Drafts read the encoder
tokens as their context; generated tokens follow it as a separate sequence.
"""

import json
import os
from typing import Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.base import Context, DecodeStart, Family
from specdec_jax.families.t5 import checkpoints, embed
from specdec_jax.families.t5 import decode as t5_decode
from specdec_jax.families.t5 import sharding as t5_sharding
from specdec_jax.families.feature_head import feature_taps
from specdec_jax.families.t5.config import CONFIGS, T5Config
from specdec_jax.families.t5.feature_head import T5FeatureHead
from specdec_jax.families.t5.model import Model, check_tokens, init_params
from specdec_jax.families.t5.network import T5

Array = jax.Array


def shift_right(targets: Array, start_id: int = 0) -> Array:
  """Decoder inputs [batch, len]: targets shifted right by one, `start_id` first."""
  return jnp.pad(targets, ((0, 0), (1, 0)), constant_values=start_id)[:, :-1]


def encoder_lengths(encoder_tokens: Array, pad_id: int) -> Array:
  """[batch] int32: where each right-padded row [batch, enc_len] ends, after its
  last non-padding token (traceable: the T5X adapter calls it under jit)."""
  real = encoder_tokens != pad_id
  width = encoder_tokens.shape[1]
  return jnp.where(real.any(axis=1), width - jnp.argmax(real[:, ::-1], axis=1),
                   0).astype(jnp.int32)


class T5Family(Family):
  name = "t5"
  config_type = T5Config
  model_type = Model
  supports_trees = True
  supports_features = True
  architectures = tuple(f"{a} (model_type {t})" for a, t in (
      ("T5ForConditionalGeneration", "t5"), ("MT5ForConditionalGeneration", "mt5"))) + (
          "T5X checkpoints", "Orbax checkpoints of T5X trees")

  def named_configs(self) -> Mapping[str, T5Config]:
    return CONFIGS

  def init_params(self, config: T5Config, seed: int = 0):
    return init_params(config, seed)

  def abstract_params(self, config: T5Config):
    return t5_sharding.abstract_params(config)

  # -- Decoding --------------------------------------------------------------

  def check_inputs(self, config: T5Config, tokens, lengths, max_decode_steps: int
                   ) -> Tuple[Array, Array]:
    """encoder tokens [batch, enc_len], `pad_id`-padded on the right; no lengths.

    No position limit to check: T5's relative position buckets cover any
    length (distances past relative_attention_max_distance share a bucket),
    and padding is 0 by design, read from the tokens."""
    if lengths is not None:
      raise ValueError("prompt_lengths is for decoder-only models; a T5 model reads "
                       f"{config.pad_id}-padded encoder_tokens")
    tokens = check_tokens(tokens)
    host = np.asarray(tokens)
    if host.max() >= config.vocab_size or host.min() < 0:
      raise ValueError(f"encoder_tokens hold ids outside [0, {config.vocab_size})")
    return tokens, encoder_lengths(tokens, config.pad_id)

  def text_inputs(self, config: T5Config, rows, width: int):
    """Encoder tokens [n, width]: each row's ids then EOS (a tokenizer that already
    ends rows with EOS, as HF's T5 tokenizer.json does, gets no second one), cut to
    width - 1 ids plus EOS, `pad_id`-padded; no lengths. Cutting is T5's convention
    for long task inputs (CNN/DM articles): the encoder reads the input, the
    decoder does not continue it."""
    if width < 2:
      raise ValueError(f"T5 encoder inputs need width >= 2 (ids and EOS), got {width}")
    inputs = np.full((len(rows), width), config.pad_id, np.int32)
    for i, row in enumerate(rows):
      ids = list(row)
      if ids and ids[-1] == config.eos_id:
        ids = ids[:-1]
      ids = ids[:width - 1] + [config.eos_id]
      inputs[i, :len(ids)] = ids
    return inputs, None

  def context(self, tokens: Array, lengths: Array) -> Context:
    return Context(tokens, lengths, continued=False)

  def start(self, config: T5Config, params, tokens: Array, lengths: Array,
            max_decode_steps: int) -> DecodeStart:
    cache = T5(config).apply({"params": params}, tokens, max_decode_steps, method=T5.init_cache)
    batch = tokens.shape[0]
    return DecodeStart(cache, jnp.full((batch,), config.decoder_start_id, jnp.int32),
                       jnp.zeros((batch,), jnp.int32))

  def block_fn(self, config: T5Config, params):
    return t5_decode.block_fn(params, config)

  # -- Features (feature drafts) -------------------------------------------

  def feature_dim(self, config: T5Config, layers=None) -> int:
    """len(taps) * emb (`feature_taps` over the decoder's layers: None / "last" = its
    last hidden state after the final norm, which feeds the logits)."""
    return len(feature_taps(config.num_decoder_layers, layers)) * config.emb_dim

  def start_features(self, config: T5Config, params, tokens: Array, lengths: Array,
                     max_decode_steps: int, layers=None):
    """`start` (the same cache), no prompt features ([batch, 0, f]: the decoder starts
    from its start token alone, scored at the first verification) and the memory
    dict(encoded [batch, S, emb], encoder_mask [batch, S] bool): the encoder
    outputs, computed once here, that a feature head cross-attends to."""
    cache, encoded = T5(config).apply({"params": params}, tokens, max_decode_steps,
                                      method=T5.init_cache_encoded)
    batch = tokens.shape[0]
    start = DecodeStart(cache, jnp.full((batch,), config.decoder_start_id, jnp.int32),
                        jnp.zeros((batch,), jnp.int32))
    features = jnp.zeros((batch, 0, self.feature_dim(config, layers)), jnp.float32)
    return start, features, dict(encoded=encoded, encoder_mask=cache["encoder_mask"])

  def feature_block_fn(self, config: T5Config, params, layers=None):
    """The fused block callback (`decode.decode_block`) that also returns the
    decoder's features `layers` names (causal or tree blocks)."""
    return t5_decode.feature_block_fn(params, config,
                                      feature_taps(config.num_decoder_layers, layers))

  def embedded_config(self, config: T5Config, shape, dtype=None) -> T5Config:
    return embed.embedded_config(config, shape, dtype)

  def embed_params(self, params, config: T5Config, large: T5Config):
    return embed.embed_params(params, config, large)

  def embed_feature_head_params(self, head_params, config: T5Config, large: T5Config):
    return embed.embed_feature_head_params(head_params, config, large)

  def feature_head(self, config: T5Config, fc_bias: bool = False):
    """The EAGLE-1 head for T5 (`feature_head.T5FeatureHead`: one decoder layer that
    also cross-attends to the encoder outputs). T5 projections have no biases."""
    if fc_bias:
      raise ValueError("a T5 feature head's fc has no bias (T5 projections have none)")
    return T5FeatureHead(config)

  def cache_length(self, config: T5Config, context_width: int, max_decode_steps: int) -> int:
    return int(max_decode_steps)

  def self_attention_cache(self, cache):
    """self_key / self_value of each layer; not the cross-attention keys/values
    nor the encoder mask (their "length" is the encoder's)."""
    t5_sharding.cache_logical_axes(cache)  # Validates the layout.
    return dict(layers=[{name: name in ("self_key", "self_value") for name in layer}
                        for layer in cache["layers"]],
                encoder_mask=False)

  def check_draft(self, draft_config: T5Config, target_config: T5Config) -> None:
    super().check_draft(draft_config, target_config)
    for name in ("eos_id", "pad_id"):
      if getattr(draft_config, name) != getattr(target_config, name):
        raise ValueError(f"draft {name} {getattr(draft_config, name)} differs from the "
                         f"target's {getattr(target_config, name)}")

  # -- Training --------------------------------------------------------------

  def token_logits(self, config: T5Config, params, batch):
    """batch: {'inputs': [batch, enc_len], 'targets': [batch, len]} int32, 0 = padding."""
    targets = batch["targets"]
    logits = T5(config).apply({"params": params}, batch["inputs"],
                              shift_right(targets, config.decoder_start_id))
    return logits, targets, (targets != config.pad_id).astype(jnp.float32)

  def teacher_features(self, config: T5Config, params, batch, layers=None):
    """batch: {'inputs': [batch, S], 'targets': [batch, T]} int32, 0 = padding.
    tokens: the decoder's inputs (`shift_right`: the start token, then
    targets[:-1]); features: the decoder's teacher-forced features there
    (feature t produced the law of targets[t]); weights: targets != pad;
    memory: dict(encoded [batch, S, emb], encoder_mask [batch, S] bool), the
    encoder outputs and mask a head cross-attends to (`start_features`' memory)."""
    inputs = jnp.asarray(batch["inputs"], jnp.int32)
    targets = jnp.asarray(batch["targets"], jnp.int32)
    decoder_inputs = shift_right(targets, config.decoder_start_id)
    module = T5(config)
    features = module.apply({"params": params}, inputs, decoder_inputs,
                            feature_taps(config.num_decoder_layers, layers),
                            method=T5.decoder_features)
    encoded = module.apply({"params": params}, inputs, method=T5.encode)
    return dict(tokens=decoder_inputs, features=features,
                weights=(targets != config.pad_id).astype(jnp.float32),
                memory=dict(encoded=encoded, encoder_mask=inputs != config.pad_id))

  def continuation_batch(self, config: T5Config, tokens, lengths, sequences, sequence_lengths):
    """{'inputs': the encoder tokens, 'targets': the generated sequences (0 after EOS)}."""
    return dict(inputs=np.asarray(tokens, np.int32), targets=np.asarray(sequences, np.int32))

  # -- Sharding --------------------------------------------------------------

  def param_logical_axes(self, path: Sequence[str], ndim: int):
    return t5_sharding.param_logical_axes(path, ndim)

  def cache_logical_axes(self, cache):
    return t5_sharding.cache_logical_axes(cache)

  def abstract_cache(self, config: T5Config, batch: int, context_width: int,
                     max_decode_steps: int):
    return t5_sharding.abstract_cache(config, batch, context_width, max_decode_steps)

  # -- Checkpoints -----------------------------------------------------------

  def detect(self, path: str) -> bool:
    """T5 checkpoints: T5X, Orbax, `save_model`'s, or HF directories of T5 / mT5."""
    if "://" in path:
      return True  # Remote paths are T5X / Orbax (TensorStore).
    if os.path.isfile(path):
      return os.path.basename(path) == "checkpoint"
    if not os.path.isdir(path):
      return False
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
      return True  # T5X / Orbax / specdec layouts; `detect_format` says which.
    with open(config_file) as f:
      hf = json.load(f)
    return hf.get("model_type") in checkpoints.HF_MODEL_TYPES

  def load(self, path: str, *, dtype: Optional[str] = None, place=None, **options) -> Model:
    return checkpoints.load_checkpoint_model(path, dtype=dtype, place=place, **options)

  def export_hf(self, model: Model, directory) -> None:
    """A `T5ForConditionalGeneration` directory (T5X / Orbax: `checkpoints.export_t5x`,
    `checkpoints.save_model`)."""
    checkpoints.export_hf(model, directory)


FAMILY = T5Family()
