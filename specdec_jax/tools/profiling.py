"""Timing model calls the way the decode loops make them: the inputs to the theory.

c (draft step / target step) and the cost curve C(k) (target scoring k tokens
in one call / one token) decide what speculative decoding can gain on a given
machine (Theorem 3.8 assumes C(k) = 1). Every script that reports them uses
these functions, so the numbers mean the same thing everywhere.

Models of every registered family are timed through the family contract
(`families/base.py`): `family.start` builds the cache as `generate` does and
`family.block_fn` is the step the decode loops run. A `block_fn_for` hook
(config -> (params -> block callback at absolute positions)) times another
formulation of a family's step, e.g. T5's `attention=` variants:
`lambda cfg: lambda p: t5_decode.block_fn(p, cfg, "dots")`.
"""

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core.sampling import Sampling
from specdec_jax.families.base import BlockFn, shift_block_fn
from specdec_jax.families.registry import family_of

BlockFnFor = Callable[[Any], Callable[[Any], BlockFn]]


def family_block_fn(config) -> Callable[[Any], BlockFn]:
  """The default `block_fn_for`: params -> the family's block callback (what `generate` runs)."""
  family = family_of(config)
  return lambda params: family.block_fn(config, params)


@functools.lru_cache(maxsize=None)
def _start_fn(config, max_decode_steps: int):
  """jit: (params, tokens, lengths) -> the family's `DecodeStart` (cache, first inputs, offset)."""
  family = family_of(config)
  return jax.jit(lambda params, tokens, lengths: family.start(config, params, tokens, lengths,
                                                              max_decode_steps))


@functools.lru_cache(maxsize=None)
def _timing_programs(config, block_fn_for: BlockFnFor, ks: Tuple[int, ...], calls: int,
                     batch: int, context_width: int, max_len: int):
  """(prepare, {k: loop}): jitted programs timing `calls` block calls of k tokens.

  A family's block callback may do params-only work when it is built (T5's
  fused kernels are folded and stacked from the T5X tree) that a decode loop
  does once per decode. `prepare(params, cache) -> prepared` runs that work
  once, outside the timed loop, by `jax.closure_convert`: the arrays the
  callback closes over become `prepared` (deduplicated over the ks, so the
  folded weights are held once), and `loop[k](prepared, cache, positions
  [batch], offset [batch]) -> [batch]` replays the callback on them.

  The loop carries the cache as the decoders do, so keys/values are written in
  place, and sums the max logit of every block position per call, so no work
  is dead code: summing one logit let XLA drop the last layer's MLP and most
  of the LM head for the other positions, and C(8) of a GPT-2-medium-shaped
  target read 1.77 where a decode loop pays ~2.5 (BENCHMARKS.md, "Issue 30"). Tokens and
  positions change every call, as in a decode loop: with fixed ones XLA would
  hoist the token-only work (embedding, position bias) out of the loop and a
  small draft's step would read too cheap.
  """
  del context_width, max_len  # Part of the cache's shape: one program set per shape.
  converted = {}  # k -> (the callback as a function of its hoisted arrays, their slots)

  def prepare(params, cache):
    block_fn = block_fn_for(config)(params)
    hoisted, slot_of = [], {}
    for k in ks:
      fn, consts = jax.closure_convert(block_fn, jnp.zeros((batch, k), jnp.int32),
                                       jnp.zeros((batch,), jnp.int32), cache)
      slots = []
      for const in consts:
        if id(const) not in slot_of:
          slot_of[id(const)] = len(hoisted)
          hoisted.append(const)
        slots.append(slot_of[id(const)])
      converted[k] = (fn, tuple(slots))
    return hoisted

  def loop(k):
    def run(prepared, cache, positions, offset):
      fn, slots = converted[k]
      consts = [prepared[i] for i in slots]
      block_fn = shift_block_fn(lambda tokens, pos, cache: fn(tokens, pos, cache, *consts),
                                offset)

      def body(i, carry):
        cache, total = carry
        tokens = jnp.full((batch, k), 2, jnp.int32) + i % 3
        logits, cache = block_fn(tokens, positions + i % 2, cache)
        return cache, total + jnp.max(logits, axis=-1).sum(axis=-1)

      _, total = jax.lax.fori_loop(0, calls, body, (cache, jnp.zeros((batch,), jnp.float32)))
      return total

    return jax.jit(run)

  return jax.jit(prepare), {k: loop(k) for k in ks}


def time_block_calls(models: Dict[str, Any], inputs, max_len: int, ks: Sequence[int],
                     repeats: int, calls: int = 8, lengths=None,
                     block_fn_for: Optional[BlockFnFor] = None) -> Dict[str, Dict[int, float]]:
  """Median ms of one block call of k tokens, for each model and k.

  Args:
    models: name -> model of any registered family; all timed on the same
      inputs.
    inputs: [batch, C] int32, what `generate` takes (T5: encoder tokens;
      decoder-only: right-padded prompts).
    max_len: decode steps the cache is built for; blocks are scored half way
      into them (loop positions).
    ks: block sizes.
    repeats: timed samples per (model, k), interleaved so drift hits all alike.
    calls: calls per sample, in one compiled loop (amortises dispatch).
    lengths: [batch] int32 prompt lengths where the family reads them
      (`generate`'s `prompt_lengths`), else None.
    block_fn_for: config -> (params -> block callback at absolute positions);
      default `family_block_fn`, the step the decode loops run.
  Returns:
    {model name: {k: ms}}.
  """
  block_fn_for = family_block_fn if block_fn_for is None else block_fn_for
  ks = tuple(ks)
  if max(ks) + 1 > max_len:
    # The loop alternates positions p and p + 1.
    raise ValueError(f"blocks of up to {max(ks)} tokens need max_len >= {max(ks) + 1}, got "
                     f"{max_len}")
  run = {}
  for name, model in models.items():
    family, config = family_of(model), model.config
    tokens, row_lengths = family.check_inputs(config, inputs, lengths, max_len)
    start = _start_fn(config, max_len)(model.params, tokens, row_lengths)
    batch, width = tokens.shape
    prepare, loops = _timing_programs(config, block_fn_for, ks, calls, batch, width, max_len)
    prepared = prepare(model.params, start.cache)
    for k in ks:
      # One below the middle, so the loop's alternating +1 stays inside the cache.
      positions = jnp.full((batch,), max(0, max_len // 2 - k - 1), jnp.int32)
      run[(name, k)] = functools.partial(loops[k], prepared, start.cache, positions,
                                         start.offset)
  for job in run.values():
    jax.block_until_ready(job())  # Compile.
  samples = {job: [] for job in run}
  for _ in range(repeats):
    for job, fn in run.items():
      start_time = time.perf_counter()
      jax.block_until_ready(fn())
      samples[job].append((time.perf_counter() - start_time) / calls * 1e3)
  out = {name: {} for name in models}
  for (name, k), ms in samples.items():
    out[name][k] = statistics.median(ms)
  return out


def block_step_seconds(model, inputs, k: int, max_decode_len: int, repeats: int,
                       lengths=None) -> float:
  """Median seconds of one block call scoring k tokens per row (see time_block_calls)."""
  ms = time_block_calls({"model": model}, inputs, max_decode_len, [k], repeats,
                        lengths=lengths)
  return ms["model"][k] / 1e3


def start_ms(model, inputs, max_decode_steps: int, repeats: int, lengths=None) -> float:
  """Median ms of the family's start at batch 1 (the prompt's prefill; T5: the encoder and
  the cross-attention keys/values): what every decode pays once, before its first step."""
  family, config = family_of(model), model.config
  tokens, row_lengths = family.check_inputs(config, inputs[:1], None if lengths is None else
                                            lengths[:1], max_decode_steps)
  fn = _start_fn(config, max_decode_steps)
  jax.block_until_ready(fn(model.params, tokens, row_lengths))  # Compile.
  samples = []
  for _ in range(repeats):
    start_time = time.perf_counter()
    jax.block_until_ready(fn(model.params, tokens, row_lengths))
    samples.append((time.perf_counter() - start_time) * 1e3)
  return statistics.median(samples)


@dataclasses.dataclass
class PairedTimes:
  """Per-input timings of target-only vs speculative `generate` (see time_generate_pairs).

  base_seconds: [n] the fastest exact target-only decoding (block width
    `base_width`) per input; spec_seconds: [n] speculative decoding.
  base_width: the target-only block width that was fastest over all inputs
    (1 or the speculative loop's width W): speedups are against it.
  reference_width: W, the width of the target-only decoding that speculative
    outputs are checked against (identical greedy outputs by construction).
  width_seconds: {width: [n]} per-input medians of each target-only width.
  reference_outputs / spec_outputs: [n] `GenerateOutput`s of the last call.
  """
  base_seconds: List[float]
  spec_seconds: List[float]
  base_width: int
  reference_width: int
  width_seconds: Dict[int, List[float]]
  reference_outputs: List[Any]
  spec_outputs: List[Any]

  @property
  def identical(self) -> bool:
    """Greedy: every speculative output equals target-only decoding at width W."""
    return all(np.array_equal(np.asarray(r.sequences), np.asarray(s.sequences))
               for r, s in zip(self.reference_outputs, self.spec_outputs))


def time_generate_pairs(target, inputs, repeats: int, base_kwargs, spec_kwargs,
                        prompt_lengths=None) -> PairedTimes:
  """Times target-only and speculative `generate` on each input row at batch 1, paired.

  The baseline is the *fastest exact* target-only decoding: the target at the
  speculative loop's block width W (whose greedy output speculative decoding
  reproduces bit for bit) and at width 1 (often faster on CPUs, where wider
  blocks cost more) are both timed, and speedups use the faster one, so the
  fixed width never flatters a speedup.

  Per input: one untimed call of each side (compiles on the first input), then
  `repeats` rounds of all sides, the order rotating every round, so a change in
  the load of a shared machine hits every side alike.

  Args:
    target: the target, a model of any registered family.
    inputs: [n, C] int32, what `generate` takes (T5: encoder tokens;
      decoder-only: right-padded prompts).
    base_kwargs / spec_kwargs: `generate` keyword arguments of each side
      (spec_kwargs carries `draft` and `gamma`). A `block_width` in
      base_kwargs pins the baseline to that width alone.
    prompt_lengths: [n] int32 where the family reads them (decoder-only), else None.
  Returns:
    PairedTimes.
  """
  from specdec_jax.core.decoding import resolve_block_width

  gamma = spec_kwargs.get("gamma", 4) if spec_kwargs.get("draft") is not None else None
  # The width `generate` resolves for the speculative side (its default
  # depends on the target's dtype and the platform), pinned on both sides.
  width = resolve_block_width(spec_kwargs.get("block_width"), gamma, dtype=target.config.dtype)
  sides = {("base", width): dict(base_kwargs, block_width=width)}
  if "block_width" in base_kwargs:
    sides = {("base", base_kwargs["block_width"]): dict(base_kwargs)}
  elif width != 1:
    sides[("base", 1)] = dict(base_kwargs, block_width=1)
  sides[("spec", width)] = dict(spec_kwargs, block_width=width)

  medians, last = time_generate_sides(target, inputs, repeats, sides, prompt_lengths)
  base_sides = [side for side in sides if side[0] == "base"]
  fastest = min(base_sides, key=lambda side: sum(medians[side]) if repeats else side[1])
  reference = ("base", width) if ("base", width) in sides else fastest
  return PairedTimes(
      base_seconds=medians[fastest], spec_seconds=medians[("spec", width)],
      base_width=fastest[1], reference_width=reference[1],
      width_seconds={side[1]: medians[side] for side in base_sides},
      reference_outputs=last[reference], spec_outputs=last[("spec", width)])


def time_generate_sides(target, inputs, repeats: int, sides: Dict[Any, Dict[str, Any]],
                        prompt_lengths=None, warmup: str = "each"
                        ) -> Tuple[Dict[Any, List[float]], Dict[Any, List[Any]]]:
  """Times several `generate` configurations ("sides") of one target on each input at batch 1.

  Per input: one untimed call of each side (compiles on the first input), then
  `repeats` rounds of all sides, the order rotating every round, so a change in
  the load of a shared machine hits every side alike.

  Args:
    target: a model of any registered family.
    inputs: [n, C] int32 (T5: encoder tokens; decoder-only: right-padded prompts).
    sides: {name: `generate` keyword arguments}.
    prompt_lengths: [n] int32 where the family reads them, else None.
    warmup: 'each' input runs every side once untimed first; 'first': only the first
      input (the compile), so later inputs cost only their timed rounds (repeats >= 1).
  Returns:
    ({name: [n] median seconds per input}, {name: [n] `GenerateOutput`s of the last call}).
  """
  from specdec_jax.generation import generate

  def timed(x, kwargs):
    start = time.perf_counter()
    out = generate(target, *x, **kwargs)
    jax.block_until_ready(out.sequences)
    return time.perf_counter() - start, out

  medians = {side: [] for side in sides}
  last = {side: [] for side in sides}
  order = list(sides)
  for i in range(len(inputs)):
    x = (inputs[i:i + 1], None if prompt_lengths is None else prompt_lengths[i:i + 1])
    outs = ({side: timed(x, kwargs)[1] for side, kwargs in sides.items()}
            if warmup == "each" or i == 0 or not repeats else {})
    times = {side: [] for side in sides}
    for repeat in range(repeats):
      shift = repeat % len(order)
      for side in order[shift:] + order[:shift]:
        seconds, outs[side] = timed(x, sides[side])
        times[side].append(seconds)
    for side in sides:
      medians[side].append(statistics.median(times[side]) if repeats else float("nan"))
      last[side].append(outs[side])
  return medians, last


def time_proposals(target, drafts: Dict[str, Any], inputs, max_len: int, gamma: int,
                   repeats: int, calls: int = 8, lengths=None,
                   temperature: float = 0.0) -> Dict[str, float]:
  """Median ms of one whole proposal of `gamma` tokens, for each draft of any kind.

  Where `time_block_calls` times a draft model's k-token call, this times what
  the chain loop runs: the draft's chain proposer at (temperature, topk 0, topp 1)
  (the draft's calls plus sampling its gamma tokens), so a feature head
  (`FeatureDraft`: one layer and the target's LM head per token), a model
  draft and an n-gram table are measured alike; per drafted token it is
  ms / gamma. The state is the draft's `init_state` on the target family's
  context (a feature draft gets zero features: costs do not depend on their
  values), built once outside the timed program (no prefill is timed), then
  carried through `calls` proposals in one compiled loop at loop
  positions max_len // 2 and one past it, alternately; pending tokens (a
  feature draft's) change every call so no call's work is hoisted.

  Args:
    target: the target model (its family builds the context).
    drafts: name -> `Draft` (models are wrapped by `drafts.as_draft`).
    inputs / lengths: as `generate` takes them ([batch, C] int32 / [batch] or None).
    max_len: decode steps the draft's state is built for.
    gamma: tokens per proposal.
    repeats / calls: timed samples (interleaved over drafts) / proposals per sample.
  Returns:
    {draft name: ms per proposal}.
  """
  # drafts import families; profiling is below them
  from specdec_jax.drafts import as_draft
  from specdec_jax.drafts.base import DraftStart, ProposalPlan
  plan = ProposalPlan(Sampling(temperature, 0, 1.0), gamma, gamma + 1)
  family, config = family_of(target), target.config
  tokens, row_lengths = family.check_inputs(config, inputs, lengths, max_len)
  batch = tokens.shape[0]
  if max_len < 4:
    raise ValueError(f"max_len must be >= 4 to time proposals, got {max_len}")
  run = {}
  for name, draft in drafts.items():
    draft = as_draft(draft)
    draft.check_compatible(config)

    # The state is built once, outside the timed program (a prefill is no proposal).
    state = jax.jit(lambda params, tokens, row_lengths, draft=draft: draft.init_state(
        params, DraftStart(family.context(tokens, row_lengths), max_len, gamma)))(
            draft.params, tokens, row_lengths)

    def loop(params, state, rng, draft=draft):
      propose = draft.proposer(params, plan).propose
      sequences = jnp.full((batch, max_len + 1), 2, jnp.int32)
      middle = max_len // 2 - gamma - 1

      def body(i, carry):
        state, total = carry
        if isinstance(state, dict) and "pending_tokens" in state:
          state = dict(state, pending_tokens=(state["pending_tokens"] + i % 3) % draft.vocab_size)
        positions = jnp.full((batch,), max(middle, 0), jnp.int32) + i % 2
        drafted, probs, _, state = propose(jax.random.fold_in(rng, i), state, sequences,
                                           positions)
        return state, total + drafted[:, -1].astype(jnp.float32) + probs[:, -1, 0]

      _, total = jax.lax.fori_loop(0, calls, body, (state, jnp.zeros((batch,), jnp.float32)))
      return total

    run[name] = functools.partial(jax.jit(loop), draft.params, state, jax.random.PRNGKey(0))
  for job in run.values():
    jax.block_until_ready(job())  # Compile.
  samples = {name: [] for name in run}
  for _ in range(repeats):
    for name, fn in run.items():
      start_time = time.perf_counter()
      jax.block_until_ready(fn())
      samples[name].append((time.perf_counter() - start_time) / calls * 1e3)
  return {name: statistics.median(ms) for name, ms in samples.items()}
