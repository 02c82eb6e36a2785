"""`generate`: the one entry point over every model family and every draft kind.

Four stages, each a function of its own:

    settings  = plan_settings(config, draft, ...)        settings.py: every check, before work
    placement = plan_placement(family, draft, ...)       placement.py: devices, mesh, processes
    check_memory(...)                                    memory.py: a cache that cannot fit
    program   = PROGRAMS.get(key, build_program(...))    programs.py: the compiled decode

then the program runs and its outputs are read back (a new program's first
call, which traces and compiles it, is logged at INFO with its seconds). The
family of the target (`families.registry.family_of`) says how a decode
starts and scores blocks; the draft says what it reads, its state and its
proposer (`drafts.base`).
"""

import dataclasses
import time
from typing import Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import memory
from specdec_jax import sharding
from specdec_jax.core.dtypes import check_matmul_precision, matmul_precision_scope
from specdec_jax.core.outputs import GenerateOutput, SpeculativeStats, make_output
from specdec_jax.families.base import check_tokens
from specdec_jax.families.registry import family_of, is_model
from specdec_jax.placement import plan_placement
from specdec_jax.programs import PROGRAMS, build_program, program_key
from specdec_jax.settings import (check_draft, check_steps, plan_settings, platform_of, sampled,
                                  warn_once)

Array = jax.Array


def compile_count() -> int:
  """How many distinct decode programs `generate` has built (for benchmarks)."""
  return PROGRAMS.count("program")


def generate(model, inputs, prompt_lengths=None, *, max_decode_steps: int,
             temperature: float = 0.0,
             topk: int = 0, topp: Optional[float] = None, eos_id: Optional[int] = None,
             rng: Optional[Array] = None, draft=None, gamma: int = 4,
             verification: str = "token", block_width: Optional[int] = None,
             matmul_precision: Optional[str] = None, batch_invariant: bool = False,
             partitioner: Optional[sharding.Partitioner] = None,
             draft_partitioner: Optional[sharding.Partitioner] = None,
             process_local: bool = False, global_outputs: bool = False) -> GenerateOutput:
  """Decodes `inputs` with `model`, speculatively when `draft` is given.

  Args:
    model: the target, a model of any registered family (`Model` for T5,
      `DecoderOnlyModel`, ...).
    inputs: [batch, C] int32. T5: encoder tokens, 0-padded on the right.
      Decoder-only: the prompts, right-padded (row b is inputs[b, :L[b]]).
    prompt_lengths: decoder-only: [batch] prompt lengths L in [1, C] (None:
      every row is C long; then a row that ends in the pad id is an error, as
      right padding without its lengths would be decoded as text). T5 takes
      none. L + max_decode_steps - 1 must not exceed the model's positions.
    max_decode_steps: tokens to generate per row (>= 1).
    temperature / topk / topp: sampling (temperature 0 = greedy; topk 0 and
      topp None: no truncation, topp a mass in (0, 1]); the draft is adjusted
      the same way, so outputs are distributed exactly as without it.
    eos_id: defaults to the model's (a model without one never stops early).
    rng: PRNG key (default PRNGKey(0): sampling without one returns the same
      sample every call, which warns once per process).
    draft: a smaller model of the target's family, or any
      `specdec_jax.drafts.Draft` (n-gram, prompt lookup, adaptive, ...). A
      `TreeDraft` / `DynamicTreeDraft` proposes a token tree each iteration,
      scored in one block of block_width slots (>= its `num_nodes`; default
      on CPU float32: its num_nodes) and verified by recursive rejection
      sampling (`core.tree_decoding`); gamma is then unused.
    gamma: tokens drafted per iteration.
    verification: how drafts are kept (`core.verification.VERIFIERS`): "token"
      (Leviathan et al.: up to the first rejection) or "block" (Sun et al.
      2025: the optimal block rule, `core.verification.block`; same output
      law, at least as many tokens per iteration on average, greedy outputs
      identical). Speculative decoding only: "block" without a draft is an
      error.
    block_width: width W of every target call, in both the target-only and
      the speculative loop. Default (`decoding.resolve_block_width`): in
      float32 on CPU, 1 for target-only decoding and gamma + 1 for
      speculative decoding (the cheapest widths there; greedy outputs with
      and without a draft were identical on every near-tie row tested, but
      not by construction: docs/exactness.md); elsewhere (bf16, fp16,
      accelerators) `decoding.DEFAULT_BLOCK_WIDTH` = 8 in both loops, which
      makes them identical bit for bit by construction (gamma 1..7; a
      gamma + 1 wider than W is an error naming the width to set). Pass the
      same block_width to both calls to get the construction on CPU too.
    matmul_precision: `jax.default_matmul_precision` for the whole decode
      ('highest' = full float32 matmuls on GPUs/TPUs, which otherwise use
      TF32 / bf16 passes); None keeps JAX's setting.
    batch_invariant: decode each row with the same batch-1 program, so a
      row's output never depends on the rows beside it (kernels for other
      batch sizes may round differently: see BENCHMARKS.md; on XLA CPU the
      families' norms and softmaxes are summed batch-invariantly,
      `core.rows`, and greedy bf16 rows matched batch 1 in the tests, so
      this is for GPUs/TPUs and MoE routing). Costs the batch's
      parallelism: rows run one after another. Sampled rows use
      fold_in(rng, row) as their key.
    partitioner: run under this `sharding.Partitioner`'s mesh: params, inputs
      and the target cache are laid out by its rules (pass params already
      sharded, e.g. from `load_sharded_model`, to avoid a copy). A mesh over
      several processes (`jax.distributed`): every process calls `generate`
      with the same global `inputs` (host data) and rng, each feeds only its
      own devices' rows, and every process gets the whole outputs, as arrays
      on its own first device.
    draft_partitioner: the draft's rules on the same mesh (default: weights
      replicated, batch over `data`).
    process_local: per-host rows (T5X's host-local input). `inputs` /
      `prompt_lengths` are this process's rows only, [b, C] / [b], the same
      b and C on every process; the global batch is the processes' rows
      concatenated in process order (`multihost.global_batch`), decoded as
      one batch of P * b rows on the partitioner's mesh, which must span
      every process. Returns this process's rows of the outputs
      (`multihost.process_row_block(b)` of the global ones; gather them with
      `multihost.gather_rows` for one writer, or pass global_outputs).
      Every process passes the same rng and settings. On one process it
      changes nothing.
    global_outputs: with process_local, return the whole global batch's
      outputs (every process's rows, in process order) instead of this
      process's: free, as the decode's outputs are replicated anyway.
  Returns:
    GenerateOutput: sequences [batch, max_decode_steps] (the new tokens; 0
    after EOS), lengths [batch] (tokens up to and including EOS), and `stats`
    when a draft was used (batch = b, this process's rows, with process_local).
  """
  family = family_of(model)
  if not is_model(model):
    raise TypeError(f"generate takes a model (config + params), got {type(model).__name__}")
  if rng is None and sampled(temperature):
    warn_once("generate: sampling without rng",
              f"generate(temperature={temperature}) without rng samples with PRNGKey(0), so "
              "every call returns the same sample; pass rng=jax.random.PRNGKey(seed), a new "
              "key per call, for fresh samples")
  if batch_invariant:
    if process_local:
      raise ValueError("batch_invariant decodes rows one at a time on one device; it does not "
                       "take process_local (drop one of them)")
    return _generate_rows(model, inputs, prompt_lengths, max_decode_steps=max_decode_steps,
                          temperature=temperature, topk=topk, topp=topp, eos_id=eos_id,
                          rng=rng, draft=draft, gamma=gamma, verification=verification,
                          block_width=block_width, matmul_precision=matmul_precision,
                          partitioner=partitioner, draft_partitioner=draft_partitioner)
  config = model.config
  steps = check_steps(max_decode_steps)
  tokens, lengths = family.check_inputs(config, inputs, prompt_lengths, steps)
  draft_obj = None if draft is None else check_draft(config, draft, inputs, prompt_lengths,
                                                      steps)
  settings = plan_settings(config, draft_obj, max_decode_steps=steps, temperature=temperature,
                           topk=topk, topp=topp, eos_id=eos_id, gamma=gamma,
                           verification=verification, block_width=block_width,
                           platform=platform_of(partitioner))
  precision = check_matmul_precision(matmul_precision)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  placement, args = plan_placement(family, draft_obj, model.params, tokens, lengths, rng,
                                   partitioner=partitioner, draft_partitioner=draft_partitioner,
                                   process_local=process_local)
  key = program_key(config, draft_obj, settings, precision, placement)
  _check_memory(family, config, draft_obj, settings, placement, key)
  built = []

  def build():
    built.append(True)
    return build_program(family, config, draft_obj, settings, placement)

  program = PROGRAMS.get(("program", key), build)
  args = placement.place(args)
  if built:
    # The first call traces and compiles (seconds to minutes for a large model): say so
    # before it starts and after, so a long first call is not mistaken for a hang.
    shape = _describe_program(config, draft_obj, settings, placement)
    logging.info("compiling decode for %s", shape)
    start = time.perf_counter()
  with matmul_precision_scope(precision):
    sequences, counters = placement.read_back(program(*args))
  if built:
    logging.info("compiling decode for %s: first call (compile) took %.2f s", shape,
                 time.perf_counter() - start)
  output = make_output(sequences, counters, settings.eos_id, settings.gamma)
  return placement.finish(output, global_outputs)


def _describe_program(config, draft, settings, placement) -> str:
  """What a new program is built for, in the log line of its compile."""
  batch, width = placement.global_shape
  kind = ("no draft" if draft is None else
          f"{type(draft).__name__} draft, gamma {settings.gamma}")
  return (f"batch {batch}, input width {width}, max_decode_steps "
          f"{settings.max_decode_steps}, {kind}, block width {settings.block_width}, "
          f"{config.dtype}")


def _check_memory(family, config, draft, settings, placement, key) -> None:
  """Before anything is allocated: a cache that cannot fit is an error naming its bytes,
  not an allocation that fails (or swaps) part way. Planned once per program and batch."""
  room = 0 if draft is None else draft.room(settings.block_width)
  parts = PROGRAMS.get(("memory", key, placement.global_shape), lambda: memory.decode_parts(
      family, config, draft, placement.global_shape, settings.max_decode_steps + room,
      settings.gamma, placement))
  memory.check_decode_memory(
      parts, placement.devices,
      f"max_decode_steps={settings.max_decode_steps} at batch {placement.global_shape[0]}")


def _generate_rows(model, inputs, prompt_lengths, *, partitioner, draft_partitioner, rng,
                   **kwargs) -> GenerateOutput:
  """`batch_invariant` decoding: every row through the batch-1 program, then concatenated."""
  if partitioner is not None or draft_partitioner is not None:
    raise ValueError("batch_invariant decodes rows one at a time; it does not take a "
                     "partitioner (shard the batch, or drop batch_invariant)")
  tokens = check_tokens(inputs, "inputs")
  rng = jax.random.PRNGKey(0) if rng is None else rng
  lengths = None if prompt_lengths is None else np.asarray(prompt_lengths)
  rows = [generate(model, tokens[i:i + 1], None if lengths is None else lengths[i:i + 1],
                   rng=jax.random.fold_in(rng, i), **kwargs)
          for i in range(tokens.shape[0])]
  sequences = jnp.concatenate([r.sequences for r in rows])
  row_lengths = jnp.concatenate([r.lengths for r in rows])
  if rows[0].stats is None:
    return GenerateOutput(sequences, row_lengths)
  per_row = {f.name: np.concatenate([getattr(r.stats, f.name) for r in rows])
             for f in dataclasses.fields(SpeculativeStats)
             if f.name != "gamma" and getattr(rows[0].stats, f.name) is not None}
  return GenerateOutput(sequences, row_lengths,
                        SpeculativeStats(gamma=rows[0].stats.gamma, **per_row))
