"""The decoder-only family (GPT-2, Llama, Qwen2/3, Mistral, Gemma, Mixtral, Qwen3-MoE,
DeepSeek-V3 and gpt-oss layouts), behind the family contract.

A decoder-only model continues a prompt. Prompts are right-padded [batch, P]
with per-row lengths L[b] (padding values never matter):

* the prefill writes each row's prompt into the cache at absolute positions
  0..P-1 (padding positions get junk that the causal mask hides and the loop
  overwrites);
* the loop's first input is the row's last prompt token, and loop position j
  is absolute position L[b] - 1 + j (the offset). Re-scoring the last prompt
  token at the first step rewrites the keys/values it already had (same
  token, same position) and yields the distribution of the first new token.

Rows of different prompt lengths therefore generate right after their own
prompts. Drafts read the prompt as their context, continued by the generated
tokens.
"""

import json
import os
from typing import Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.base import Context, DecodeStart, Family
from specdec_jax.families.decoder_only import batch as lm_data
from specdec_jax.families.decoder_only import checkpoints, eagle_checkpoints, embed
from specdec_jax.families.decoder_only import sharding as decoder_only_sharding
from specdec_jax.families.decoder_only import sparse_view as decoder_only_sparse_view
from specdec_jax.families.decoder_only.feature_head import DecoderOnlyFeatureHead
from specdec_jax.families.decoder_only.config import (DECODER_CONFIGS, DecoderOnlyConfig,
                                                      canonical_name)
from specdec_jax.families.decoder_only.model import (DecoderOnlyModel, absolute_block_fn,
                                                     absolute_feature_block_fn,
                                                     check_prompt_lengths, decode_cache_length,
                                                     feature_layers, init_decoder_only_params,
                                                     prefilled_cache, prefilled_cache_features,
                                                     teacher_forced_features)
from specdec_jax.families.decoder_only.network import DecoderOnly
from specdec_jax.families.base import check_tokens
from specdec_jax.families.head_formats import register_head_format

Array = jax.Array


class DecoderOnlyFamily(Family):
  name = "decoder_only"
  config_type = DecoderOnlyConfig
  model_type = DecoderOnlyModel
  supports_trees = True
  supports_features = True
  supports_sparse_view = True

  @property
  def architectures(self) -> Tuple[str, ...]:
    return tuple(sorted(checkpoints.ARCHITECTURES))

  def named_configs(self) -> Mapping[str, DecoderOnlyConfig]:
    return DECODER_CONFIGS

  def lookup_config(self, name: str) -> Optional[DecoderOnlyConfig]:
    return DECODER_CONFIGS.get(canonical_name(name))

  def init_params(self, config: DecoderOnlyConfig, seed: int = 0):
    return init_decoder_only_params(config, seed)

  def abstract_params(self, config: DecoderOnlyConfig):
    return decoder_only_sharding.abstract_params(config)

  # -- Decoding --------------------------------------------------------------

  def check_inputs(self, config: DecoderOnlyConfig, tokens, lengths, max_decode_steps: int
                   ) -> Tuple[Array, Array]:
    """prompts [batch, P] right-padded, lengths [batch] in [1, P] (None: all P).

    Without lengths, a row that ends in `config.pad_id` is an error: it is
    almost always right padding, which would be decoded as text. Real
    positions (the longest row's L + max_decode_steps - 1) beyond
    `config.max_positions` are an error for every layout: GPT-2's learned
    table ends there, and a rotary model was not trained past it. The padded
    width P does not count: the cache is P + N - 1 long whatever the model's
    positions, and padding slots are masked and overwritten.
    """
    tokens = check_tokens(tokens, "prompts")
    if lengths is None:
      last = np.asarray(tokens)[:, -1]
      padded = np.flatnonzero(last == config.pad_id)
      if padded.size:
        batch, width = tokens.shape
        raise ValueError(
            f"prompts row {int(padded[0])} ends in the pad id {config.pad_id} and no "
            "prompt_lengths were given, so its padding would be decoded as text: pass "
            "prompt_lengths=[...] (each row's real length); if the pad id is genuinely part "
            f"of the text, pass prompt_lengths=np.full({batch}, {width})")
    lengths = check_prompt_lengths(lengths, tokens)
    real = np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]
    ids = np.asarray(tokens)[real]
    if ids.min() < 0 or ids.max() >= config.vocab_size:
      raise ValueError(f"prompts hold ids outside [0, {config.vocab_size})")
    longest = int(np.max(np.asarray(lengths)))
    # The last loop input sits at position L + N - 2: the N-th new token is never fed back.
    needed = longest + int(max_decode_steps) - 1
    if needed > config.max_positions:
      what = ("learned positions (n_positions)" if not config.uses_rotary else
              "positions (max_position_embeddings)")
      raise ValueError(f"the longest prompt ({longest} tokens) plus max_decode_steps "
                       f"({max_decode_steps}) needs {needed} positions (the last new token is "
                       f"never fed back), but this {config.family} model has "
                       f"{config.max_positions} {what}: shorten the prompts or lower "
                       "max_decode_steps")
    return tokens, lengths

  def context(self, tokens: Array, lengths: Array) -> Context:
    return Context(tokens, lengths, continued=True)

  def start(self, config: DecoderOnlyConfig, params, tokens: Array, lengths: Array,
            max_decode_steps: int) -> DecodeStart:
    cache = prefilled_cache(config, params, tokens, lengths,
                            self.cache_length(config, tokens.shape[1], max_decode_steps))
    last = tokens[jnp.arange(tokens.shape[0]), lengths - 1]
    return DecodeStart(cache, last, lengths.astype(jnp.int32) - 1)

  def block_fn(self, config: DecoderOnlyConfig, params):
    return absolute_block_fn(config, params)

  def sparse_view(self, config: DecoderOnlyConfig, params):
    return decoder_only_sparse_view.sparse_view(config, params)

  def check_sparse_budget(self, config: DecoderOnlyConfig, budget: int) -> None:
    # Every layer already reading a window no wider than the budget: the draft would be
    # the target itself at the target's cost.
    window = config.sliding_window
    if window and all(t == "sliding_attention" for t in config.attention_types) and (
        window <= budget):
      raise ValueError(f"every layer of this target attends to a window of {window} <= "
                       f"budget={budget} positions: a sparse view of its cache reads what the "
                       "target reads, so the draft would cost a target step; use a model "
                       "draft, or a budget well below the window")

  # -- Features (feature drafts) -------------------------------------------

  def feature_dim(self, config: DecoderOnlyConfig, layers=None) -> int:
    return len(feature_layers(config, layers)) * config.emb_dim

  def start_features(self, config: DecoderOnlyConfig, params, tokens: Array, lengths: Array,
                     max_decode_steps: int, layers=None):
    """`start`, and the features of every prompt slot [batch, C, f] float32 (slot j
    of row b: the token at absolute position j; junk past lengths[b])."""
    features, cache = prefilled_cache_features(
        config, params, tokens, self.cache_length(config, tokens.shape[1], max_decode_steps),
        layers)
    last = tokens[jnp.arange(tokens.shape[0]), lengths - 1]
    return DecodeStart(cache, last, lengths.astype(jnp.int32) - 1), features, None

  def feature_block_fn(self, config: DecoderOnlyConfig, params, layers=None):
    return absolute_feature_block_fn(config, params, layers)

  def embedded_config(self, config: DecoderOnlyConfig, shape, dtype=None) -> DecoderOnlyConfig:
    return embed.embedded_config(config, shape, dtype)

  def embed_params(self, params, config: DecoderOnlyConfig, large: DecoderOnlyConfig):
    return embed.embed_params(params, config, large)

  def embed_feature_head_params(self, head_params, config: DecoderOnlyConfig,
                                large: DecoderOnlyConfig):
    return embed.embed_feature_head_params(head_params, config, large)

  def feature_head(self, config: DecoderOnlyConfig, fc_bias: bool = False):
    """The EAGLE-1 head (`feature_head.DecoderOnlyFeatureHead`): any layout, rotary or
    learned positions."""
    return DecoderOnlyFeatureHead(config, fc_bias=fc_bias)

  def cache_length(self, config, context_width: int, max_decode_steps: int) -> int:
    return decode_cache_length(context_width, max_decode_steps)

  def self_attention_cache(self, cache):
    """Every leaf: the cache is self-attention keys/values only."""
    return jax.tree_util.tree_map(lambda leaf: True, cache)

  # -- Training --------------------------------------------------------------

  def token_logits(self, config: DecoderOnlyConfig, params, batch):
    """batch: {'tokens': [batch, T] int32, 'weights': [batch, T]}; predicts tokens
    1..T-1 from the tokens before (`families.decoder_only.batch.lm_batch`)."""
    tokens = batch["tokens"]
    logits = DecoderOnly(config).apply({"params": params}, tokens[:, :-1])
    return logits, tokens[:, 1:], batch["weights"][:, 1:].astype(jnp.float32)

  def teacher_features(self, config: DecoderOnlyConfig, params, batch, layers=None):
    """batch: {'tokens': [batch, T] int32, 'weights': [batch, T]} (`batch.lm_batch`).
    tokens: the batch's; features: the target's at every position (absolute
    positions 0..T-1; feature t produced the law of token t + 1); weights: the
    batch's, as float32; memory: None (the head attends to its own keys only)."""
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    return dict(tokens=tokens, features=teacher_forced_features(config, params, tokens, layers),
                weights=jnp.asarray(batch["weights"], jnp.float32), memory=None)

  def continuation_batch(self, config, tokens, lengths, sequences, sequence_lengths):
    """Prompt + continuation rows, learning the continuation (`batch.continuation_batch`)."""
    return lm_data.continuation_batch(tokens, lengths, sequences, sequence_lengths)

  # -- Sharding --------------------------------------------------------------

  def param_logical_axes(self, path: Sequence[str], ndim: int):
    return decoder_only_sharding.param_logical_axes(path, ndim)

  def cache_logical_axes(self, cache):
    return decoder_only_sharding.cache_logical_axes(cache)

  def abstract_cache(self, config, batch: int, context_width: int, max_decode_steps: int):
    return decoder_only_sharding.abstract_cache(
        config, batch, self.cache_length(config, context_width, max_decode_steps))

  # -- Checkpoints -----------------------------------------------------------

  def detect(self, path: str) -> bool:
    """A Hugging Face directory whose config.json names a decoder-only architecture."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
      return False
    with open(config_file) as f:
      hf = json.load(f)
    architectures = hf.get("architectures") or []
    return (any(a in checkpoints.ARCHITECTURES for a in architectures) or
            (not architectures and hf.get("model_type") in checkpoints.MODEL_TYPES))

  def load(self, path: str, *, dtype: Optional[str] = None, place=None, **options):
    if options:
      raise ValueError(f"config overrides {sorted(options)} apply to random init only, not to "
                       "a checkpoint (its config.json defines the shapes)")
    return checkpoints.load_hf_decoder_only(path, dtype=dtype, place=place)

  def export_hf(self, model, directory) -> None:
    """A `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `GPT2LMHeadModel`
    (or Mistral / Gemma / Mixtral / Qwen3-MoE / DeepSeek-V3 / gpt-oss) directory, by
    `config.family`."""
    checkpoints.export_hf_decoder_only(model, directory)


FAMILY = DecoderOnlyFamily()

# The public EAGLE head formats drafting for this family's targets.
register_head_format(eagle_checkpoints.EAGLE1)
register_head_format(eagle_checkpoints.EAGLE3)
