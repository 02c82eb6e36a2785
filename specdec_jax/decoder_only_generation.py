"""`decoder_only_generate`: decoder-only models through the shared decode loops.

The loops in `specdec_jax.core.decoding` know nothing of prompts: they take block
callbacks `(tokens [batch, k], positions [batch], cache)` in *loop*
positions, where loop position 0 holds each row's first decoder input
(`inputs[:, 0]`). A decoder-only model continues a prompt, so here

* prompts are right-padded [batch, P] with per-row lengths L[b] (each row's
  tokens in its first L[b] slots; padding values never matter);
* the prefill writes each row's prompt into the cache at absolute positions
  0..P-1 (padding positions get junk that the causal mask hides and the loop
  overwrites);
* the loop's first input token is the row's last prompt token, and loop
  position j is absolute position L[b] - 1 + j. Re-scoring the last prompt
  token at the first step rewrites the keys/values it already had (same token,
  same position), and yields the distribution of the first new token.

Rows of different prompt lengths therefore generate right after their own
prompts, and advance at their own pace in the speculative loop as for T5.

Drafts get the prompts as their `init_state` "encoder tokens" with padding
set to `decoder_only_model.PROMPT_PADDING` (-1), so each recovers the rows'
prompt lengths through the unchanged `Draft` interface.
"""

import contextlib
import threading
from typing import Any, Dict, Optional

import jax
import numpy as np

from specdec_jax.families.decoder_only import sharding as decoder_only_sharding
from specdec_jax.core import decoding
from specdec_jax.core import sampling
from specdec_jax import sharding
from specdec_jax.families.decoder_only.model import (DecoderOnlyModel, absolute_block_fn,
                                            check_prompt_lengths, decode_cache_length,
                                            first_inputs, mark_prompt_padding,
                                            prefilled_cache, shift_block_fn)
from specdec_jax.core.dtypes import check_matmul_precision, matmul_precision_scope
from specdec_jax.drafts import AdaptiveGammaDraft, Draft, ModelDraft, PromptLookupDraft
from specdec_jax.drafts.decoder_only_draft import DecoderOnlyModelDraft
from specdec_jax.core.outputs import GenerateOutput, make_output
from specdec_jax.families.t5.model import Model, check_tokens
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig

Array = jax.Array

# An id no token has: rows without an EOS never stop early.
_NO_EOS = -1

_COMPILED: Dict[Any, Any] = {}
_COMPILED_LOCK = threading.Lock()


def _build(config: DecoderOnlyConfig, draft: Optional[Draft], max_decode_steps: int,
           temperature: float, topk: int, topp: float, eos_id: int, gamma: int,
           block_width: int, partitioner: Optional[sharding.Partitioner] = None):
  # Under a mesh the target is traced with its activation axis rules and its
  # cache is pinned to its sharding where it is made and after every call, so
  # the loop carry keeps that layout (as `generation.generate` does for T5).
  constrain = lambda cache: cache  # noqa: E731
  target_axes = contextlib.nullcontext
  if partitioner is not None:
    target_axes = partitioner.activation_axes

    def constrain(cache):
      return jax.lax.with_sharding_constraint(
          cache, decoder_only_sharding.cache_shardings(partitioner, cache))

  def run(params, draft_params, prompts, prompt_lengths, rng):
    max_len = decode_cache_length(prompts.shape[1], max_decode_steps)
    with target_axes():
      cache = constrain(prefilled_cache(config, params, prompts, prompt_lengths, max_len))
    block = absolute_block_fn(config, params)

    def target_block(tokens, positions, cache):
      with target_axes():
        logits, cache = block(tokens, positions, cache)
      return logits, constrain(cache)

    target_fn = shift_block_fn(target_block, prompt_lengths)
    inputs = first_inputs(prompts, prompt_lengths, max_decode_steps)
    settings = dict(temperature=temperature, topk=topk, topp=topp, block_width=block_width)
    if draft is None:
      return decoding.decode(inputs, cache, target_fn, eos_id, rng, **settings)
    draft_state = draft.init_state(draft_params, mark_prompt_padding(prompts, prompt_lengths),
                                   max_decode_steps)
    propose = draft.propose_fn(draft_params, gamma, temperature, topk, topp)
    return decoding.decode(inputs, cache, target_fn, eos_id, rng, propose_fn=propose,
                           draft_state=draft_state, gamma=gamma, **settings)

  return jax.jit(run)


def _innermost(draft: Draft) -> Draft:
  """The draft that proposes, inside any AdaptiveGammaDraft wrappers."""
  while isinstance(draft, AdaptiveGammaDraft):
    draft = draft.draft
  return draft


def as_decoder_only_draft(model: DecoderOnlyModel, draft) -> Draft:
  """The `Draft` for a decoder-only target: a `DecoderOnlyModel` is wrapped in
  `DecoderOnlyModelDraft`; `NgramDraft`, `DecoderOnlyPromptLookupDraft` and
  `AdaptiveGammaDraft` pass through.

  Raises:
    ValueError: a T5 draft (family mismatch), a draft whose prompt handling
      assumes T5 inputs, or a different vocabulary.
  """
  if isinstance(draft, DecoderOnlyModel):
    draft = DecoderOnlyModelDraft(draft)
  if isinstance(draft, Model):
    raise ValueError("a T5 (encoder-decoder) draft cannot serve a decoder-only target: the "
                     "families differ (the draft needs encoder tokens, the target continues a "
                     "prompt); use a smaller DecoderOnlyModel sharing the target's vocabulary")
  if not isinstance(draft, Draft):
    raise TypeError(f"draft must be a DecoderOnlyModel or a specdec_jax Draft, got "
                    f"{type(draft).__name__}")
  inner = _innermost(draft)
  if isinstance(inner, ModelDraft):
    raise ValueError("a T5 ModelDraft cannot serve a decoder-only target: the model families "
                     "differ; use a DecoderOnlyModel (or DecoderOnlyModelDraft) draft")
  if isinstance(inner, PromptLookupDraft):
    # It matches only generated tokens and marks input padding by pad_id.
    raise ValueError("PromptLookupDraft treats the prompt as T5 encoder input; use "
                     "DecoderOnlyPromptLookupDraft for decoder-only targets")
  draft.check_compatible(model.config)
  return draft


def decoder_only_generate(model: DecoderOnlyModel, prompts, prompt_lengths=None, *,
                          max_decode_steps: int, temperature: float = 0.0, topk: int = 0,
                          topp: float = 0.0, eos_id: Optional[int] = None,
                          rng: Optional[Array] = None, draft=None, gamma: int = 4,
                          block_width: Optional[int] = None,
                          matmul_precision: Optional[str] = None,
                          partitioner: Optional[sharding.Partitioner] = None,
                          draft_partitioner: Optional[sharding.Partitioner] = None
                          ) -> GenerateOutput:
  """Continues each row's prompt with `model`, speculatively when `draft` is given.

  Args:
    model: the target `DecoderOnlyModel`.
    prompts: [batch, P] int32, right-padded: row b's prompt is prompts[b, :L[b]].
    prompt_lengths: [batch] ints L in [1, P]; None means every row is P long.
    max_decode_steps: new tokens per row (>= 1).
    temperature / topk / topp: sampling (temperature 0 = greedy); the draft is
      adjusted the same way, so outputs are distributed exactly as without it.
    eos_id: defaults to the model's (`config.eos_id`; None = never stop early).
    rng: PRNG key (default PRNGKey(0)).
    draft: a smaller `DecoderOnlyModel` with the same vocabulary (or a
      `DecoderOnlyModelDraft`), an `NgramDraft`, a `DecoderOnlyPromptLookupDraft`,
      or an `AdaptiveGammaDraft` around one (see `as_decoder_only_draft`).
    gamma: tokens drafted per iteration.
    block_width: width W of every target call in both loops (default
      `decoding.DEFAULT_BLOCK_WIDTH`), as in `generation.generate`: equal
      widths make greedy outputs with and without a draft identical bit for bit.
    matmul_precision: `jax.default_matmul_precision` for the whole decode.
    partitioner: run on this `sharding.Partitioner`'s mesh: target params by
      its rules (`decoder_only_sharding`), prompts split over `data`, the
      target cache pinned to its layout (pass params already sharded, e.g.
      from `decoder_only_sharding.load_sharded_decoder_only`, to avoid a copy).
    draft_partitioner: a model draft's rules on the same mesh (default:
      weights replicated); other drafts' arrays are replicated.
  Returns:
    GenerateOutput: sequences [batch, max_decode_steps] (the new tokens only;
    0 after EOS), lengths [batch] (new tokens up to and including EOS), and
    `stats` when a draft was used.
  """
  tokens = check_tokens(prompts, "prompts")
  lengths = check_prompt_lengths(prompt_lengths, tokens)
  cfg = model.config
  if int(max_decode_steps) != max_decode_steps or max_decode_steps < 1:
    raise ValueError(f"max_decode_steps must be an int >= 1, got {max_decode_steps!r}")
  max_decode_steps = int(max_decode_steps)
  sampling.validate_sampling(temperature, topk, topp, cfg.vocab_size)
  real = np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]
  ids = np.asarray(tokens)[real]
  if ids.min() < 0 or ids.max() >= cfg.vocab_size:
    raise ValueError(f"prompts hold ids outside [0, {cfg.vocab_size})")
  cache_len = decode_cache_length(tokens.shape[1], max_decode_steps)
  if not cfg.uses_rotary and cache_len > cfg.max_positions:
    raise ValueError(f"prompts of width {tokens.shape[1]} plus {max_decode_steps} new tokens need "
                     f"{cache_len} positions, more than this {cfg.family} model's "
                     f"{cfg.max_positions} learned positions")
  if eos_id is None:
    eos_id = _NO_EOS if cfg.eos_id is None else cfg.eos_id
  eos_id = int(eos_id)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  draft_obj = draft_params = None
  if draft is not None:
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
      raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
    draft_obj = as_decoder_only_draft(model, draft)
    if isinstance(_innermost(draft_obj), DecoderOnlyModelDraft):
      draft_cfg = _innermost(draft_obj).model.config
      if not draft_cfg.uses_rotary and cache_len > draft_cfg.max_positions:
        raise ValueError(f"the draft's {draft_cfg.max_positions} learned positions cannot hold "
                         f"{cache_len} positions")
    draft_params = draft_obj.params
  width = decoding.resolve_block_width(block_width,
                                       int(gamma) if draft_obj is not None else None)
  precision = check_matmul_precision(matmul_precision)
  statics = (max_decode_steps, float(temperature), int(topk), float(topp), eos_id,
             int(gamma) if draft_obj is not None else 0, width)
  key = (cfg, None if draft_obj is None else draft_obj.static_key(), precision,
         partitioner) + statics
  params = model.params
  if partitioner is not None:
    if draft_partitioner is None:
      draft_partitioner = partitioner.replace(rules=sharding.DRAFT_RULES)
    # device_put is a no-op for arrays already laid out this way.
    params = jax.device_put(params, decoder_only_sharding.param_shardings(partitioner, params))
    if draft_obj is not None and isinstance(_innermost(draft_obj), DecoderOnlyModelDraft):
      draft_params = jax.device_put(draft_params, decoder_only_sharding.param_shardings(
          draft_partitioner, draft_params))
    elif draft_obj is not None:
      draft_params = jax.device_put(draft_params, partitioner.replicated())
    tokens = jax.device_put(tokens, partitioner.batch_sharding(tokens.shape, "prompts"))
    lengths = jax.device_put(lengths, partitioner.batch_sharding(lengths.shape, "prompt_lengths"))
    rng = jax.device_put(rng, partitioner.replicated())
  with _COMPILED_LOCK:
    if key not in _COMPILED:
      _COMPILED[key] = _build(cfg, draft_obj, *statics, partitioner=partitioner)
    fn = _COMPILED[key]
  with matmul_precision_scope(precision):
    sequences, stats = fn(params, draft_params, tokens, lengths, rng)
  return make_output(sequences, stats, eos_id, gamma)
