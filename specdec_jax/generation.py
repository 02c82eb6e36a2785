"""`generate`: the user-facing entry point over both decode loops, for every model family.

T5 models (`Model`) decode here; decoder-only models (`DecoderOnlyModel`)
are handed to `decoder_only_generation.decoder_only_generate`, which runs the
same loops with prompt-shifted positions.
"""

import contextlib
import dataclasses
import threading
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import decoding
from specdec_jax import decoder_only_generation
from specdec_jax.core import sampling
from specdec_jax import sharding
from specdec_jax.drafts import Draft, as_draft
from specdec_jax.core.dtypes import check_matmul_precision, matmul_precision_scope
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.families.t5.model import Model, check_tokens
from specdec_jax.families.t5.network import T5
from specdec_jax.core.outputs import GenerateOutput, SpeculativeStats, make_output

Array = jax.Array


_COMPILED: Dict[Any, Any] = {}
_COMPILED_LOCK = threading.Lock()


def compile_count() -> int:
  """How many distinct decode programs `generate` has built (for benchmarks)."""
  return len(_COMPILED)


def _build(config, draft: Optional[Draft], max_decode_steps, temperature, topk, topp, eos_id,
           gamma, block_width, shardings: Optional[sharding.GenerateShardings] = None):
  module = T5(config)
  # Under a mesh, each model is traced with its own activation axis rules,
  # and caches are pinned to their shardings where they are made and after
  # every model call, so the while-loop carry keeps that layout.
  constrain_target = constrain_draft = lambda state: state
  target_axes = draft_axes = contextlib.nullcontext
  if shardings is not None:
    constrain_target = shardings.target.constrain_cache
    constrain_draft = shardings.draft.constrain_cache
    target_axes = shardings.target.activation_axes
    draft_axes = shardings.draft.activation_axes

  def run(params, draft_params, encoder_tokens, rng):
    batch = encoder_tokens.shape[0]
    with target_axes():
      cache = constrain_target(module.apply({"params": params}, encoder_tokens,
                                            max_decode_steps, method=T5.init_cache))
    block_fn = Model(config, params).block_fn(params)

    def target_fn(tokens, positions, cache):
      with target_axes():
        logits, cache = block_fn(tokens, positions, cache)
      return logits, constrain_target(cache)

    inputs = jnp.zeros((batch, max_decode_steps), jnp.int32)
    settings = dict(temperature=temperature, topk=topk, topp=topp, block_width=block_width)
    if draft is None:
      return decoding.decode(inputs, cache, target_fn, eos_id, rng, **settings)
    with draft_axes():
      draft_state = constrain_draft(draft.init_state(draft_params, encoder_tokens,
                                                     max_decode_steps))
    draft_propose = draft.propose_fn(draft_params, gamma, temperature, topk, topp)

    def propose(rng, state, sequences, lengths):
      with draft_axes():
        *proposal, state = draft_propose(rng, state, sequences, lengths)
      return (*proposal, constrain_draft(state))

    return decoding.decode(inputs, cache, target_fn, eos_id, rng, propose_fn=propose,
                           draft_state=draft_state, gamma=gamma, **settings)

  if shardings is None:
    return jax.jit(run)
  return jax.jit(run, in_shardings=shardings.in_shardings, out_shardings=shardings.out_shardings)


def generate(model: Model, encoder_tokens, prompt_lengths=None, *, max_decode_steps: int,
             temperature: float = 0.0,
             topk: int = 0, topp: float = 0.0, eos_id: Optional[int] = None,
             rng: Optional[Array] = None, draft=None, gamma: int = 4,
             block_width: Optional[int] = None, matmul_precision: Optional[str] = None,
             batch_invariant: bool = False,
             partitioner: Optional[sharding.Partitioner] = None,
             draft_partitioner: Optional[sharding.Partitioner] = None) -> GenerateOutput:
  """Decodes `encoder_tokens` with `model`, speculatively when `draft` is given.

  Args:
    model: the target: a T5 `Model`, or a `DecoderOnlyModel` (then the call
      is `decoder_only_generation.decoder_only_generate`'s: the drafts must be
      decoder-only too, or n-gram / prompt-lookup drafts).
    encoder_tokens: T5: [batch, enc_len] int32, 0-padded on the right.
      Decoder-only: the prompts [batch, P], right-padded.
    prompt_lengths: decoder-only only: [batch] prompt lengths (None: all P).
    max_decode_steps: tokens to generate per row (>= 1).
    temperature / topk / topp: sampling (temperature 0 = greedy); the draft is
      adjusted the same way, so outputs are distributed exactly as without it.
    eos_id: defaults to the model's.
    rng: PRNG key (default PRNGKey(0)).
    draft: a smaller `Model` or any `specdec_jax.drafts.Draft`.
    gamma: tokens drafted per iteration.
    block_width: width W of every target call, in both the target-only and
      the speculative loop (default `decoding.DEFAULT_BLOCK_WIDTH` = 8, so
      gamma 1..7). Equal widths make greedy outputs with and without a draft
      identical bit for bit on every backend and dtype; a gamma + 1 wider
      than W is an error naming the width to set. Target-only decoding with
      block_width=1 is the fastest on CPU (see README, "Block width").
    matmul_precision: `jax.default_matmul_precision` for the whole decode
      ('highest' = full float32 matmuls on GPUs/TPUs, which otherwise use
      TF32 / bf16 passes); None keeps JAX's setting.
    batch_invariant: decode each row with the same batch-1 program, so a
      row's output never depends on the rows beside it (kernels for other
      batch sizes round differently: see BENCHMARKS.md). Costs the batch's
      parallelism: rows run one after another. Sampled rows use
      fold_in(rng, row) as their key.
    partitioner: run under this `sharding.Partitioner`'s mesh: params, inputs
      and the target cache are laid out by its rules (pass params already
      sharded, e.g. from `sharding.load_sharded_model`, to avoid a copy).
    draft_partitioner: the draft's rules on the same mesh (default: weights
      replicated, batch over `data`).
  Returns:
    GenerateOutput; `stats` is set when a draft was used.
  """
  if batch_invariant:
    tokens = check_tokens(encoder_tokens, "prompts" if isinstance(model, DecoderOnlyModel)
                          else "encoder_tokens")
    if partitioner is not None or draft_partitioner is not None:
      raise ValueError("batch_invariant decodes rows one at a time; it does not take a "
                       "partitioner (shard the batch, or drop batch_invariant)")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    lengths = None if prompt_lengths is None else np.asarray(prompt_lengths)
    rows = [generate(model, tokens[i:i + 1], None if lengths is None else lengths[i:i + 1],
                     max_decode_steps=max_decode_steps,
                     temperature=temperature, topk=topk, topp=topp, eos_id=eos_id,
                     rng=jax.random.fold_in(rng, i), draft=draft, gamma=gamma,
                     block_width=block_width, matmul_precision=matmul_precision)
            for i in range(tokens.shape[0])]
    return _concatenate_rows(rows)
  if isinstance(model, DecoderOnlyModel):
    return decoder_only_generation.decoder_only_generate(
        model, encoder_tokens, prompt_lengths, max_decode_steps=max_decode_steps,
        temperature=temperature, topk=topk, topp=topp, eos_id=eos_id, rng=rng, draft=draft,
        gamma=gamma, block_width=block_width, matmul_precision=matmul_precision,
        partitioner=partitioner, draft_partitioner=draft_partitioner)
  if not isinstance(model, Model):
    raise TypeError(f"generate takes a specdec_jax Model (T5) or DecoderOnlyModel, got "
                    f"{type(model).__name__}")
  if prompt_lengths is not None:
    raise ValueError("prompt_lengths is for decoder-only models; a T5 model reads "
                     "0-padded encoder_tokens")
  tokens = check_tokens(encoder_tokens)
  if int(max_decode_steps) != max_decode_steps or max_decode_steps < 1:
    raise ValueError(f"max_decode_steps must be an int >= 1, got {max_decode_steps!r}")
  sampling.validate_sampling(temperature, topk, topp, model.config.vocab_size)
  vocab = model.config.vocab_size
  if int(jnp.max(tokens)) >= vocab or int(jnp.min(tokens)) < 0:
    raise ValueError(f"encoder_tokens hold ids outside [0, {vocab})")
  eos_id = model.config.eos_id if eos_id is None else int(eos_id)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  draft_obj = None
  if draft is not None:
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
      raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
    draft_obj = as_draft(draft)
    draft_obj.check_compatible(model.config)
  width = decoding.resolve_block_width(block_width,
                                       int(gamma) if draft_obj is not None else None)
  precision = check_matmul_precision(matmul_precision)
  statics = (float(temperature), int(topk), float(topp), eos_id,
             int(gamma) if draft_obj is not None else 0, width)
  key = (model.config, None if draft_obj is None else draft_obj.static_key(),
         int(max_decode_steps), precision) + statics
  params = model.params
  draft_params = None if draft_obj is None else draft_obj.params
  shardings = None
  if partitioner is not None:
    key += (partitioner, draft_partitioner)
    shardings = sharding.generate_shardings(partitioner, draft_partitioner, params,
                                            draft_params, tokens.shape)
    # A no-op for arrays already laid out this way.
    params, draft_params, tokens, rng = jax.device_put(
        (params, draft_params, tokens, rng), shardings.in_shardings)
  with _COMPILED_LOCK:
    if key not in _COMPILED:
      _COMPILED[key] = _build(model.config, draft_obj, int(max_decode_steps), *statics,
                              shardings=shardings)
    fn = _COMPILED[key]
  with matmul_precision_scope(precision):
    sequences, stats = fn(params, draft_params, tokens, rng)
  return make_output(sequences, stats, eos_id, gamma)


def _concatenate_rows(rows) -> GenerateOutput:
  """One GenerateOutput from per-row outputs (batch_invariant decoding)."""
  sequences = jnp.concatenate([r.sequences for r in rows])
  lengths = jnp.concatenate([r.lengths for r in rows])
  if rows[0].stats is None:
    return GenerateOutput(sequences, lengths)
  per_row = {f.name: np.concatenate([getattr(r.stats, f.name) for r in rows])
             for f in dataclasses.fields(SpeculativeStats) if f.name != "gamma"}
  return GenerateOutput(sequences, lengths,
                        SpeculativeStats(gamma=rows[0].stats.gamma, **per_row))
