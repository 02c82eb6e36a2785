"""`generate`: the one entry point over both decode loops, for every model family.

The family of the target (`families.registry.family_of`) says how a decode
starts (cache, first inputs, offset of loop position 0), what drafts read
(its `Context`) and how a block of tokens is scored. Everything else, the
validation, the sharding, the compile cache and the choice of loop, is
shared:

    start = family.start(config, params, tokens, lengths, N)
    target = shift(family.block_fn(config, params), start.offset)
    draft_state = draft.init_state(draft_params, family.context(tokens, lengths), N)
    decoding.decode(inputs, start.cache, target, ..., propose_fn=draft.propose_fn(...))
"""

import contextlib
import dataclasses
import threading
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import sharding
from specdec_jax.core import decoding
from specdec_jax.core import sampling
from specdec_jax.core import tree_decoding
from specdec_jax.core.dtypes import check_matmul_precision, matmul_precision_scope
from specdec_jax.core.outputs import GenerateOutput, SpeculativeStats, make_output
from specdec_jax.drafts import Draft, as_draft
from specdec_jax.families.base import Family, call_block, check_tokens, shift_block_fn
from specdec_jax.families.registry import family_of, is_model

Array = jax.Array


_COMPILED: Dict[Any, Any] = {}
_COMPILED_LOCK = threading.Lock()


def compile_count() -> int:
  """How many distinct decode programs `generate` has built (for benchmarks)."""
  return len(_COMPILED)


_MEMORY: Dict[Any, Dict[str, int]] = {}


def _decode_memory(family: Family, config, draft: Optional[Draft], draft_params, tokens, lengths,
                   max_decode_steps: int, partitioner: Optional[sharding.Partitioner],
                   draft_partitioner: Optional[sharding.Partitioner]) -> Dict[str, int]:
  """{part: bytes per device} that a decode allocates for its whole length, from shapes only.

  The target cache from the family's `abstract_cache` (under a mesh,
  `sharding.plan_memory`'s bytes on the fullest device), the draft's state
  from its abstract `init_state` (a model draft under a mesh: its plan), and
  the loop's token buffers. Params exist already; activations are not
  counted (they do not grow with max_decode_steps).
  """
  batch, width = tokens.shape
  plan = lambda cfg, part: sharding.plan_memory(  # noqa: E731
      cfg, batch=batch, context_len=width, max_decode_len=max_decode_steps,
      mesh_shape=part.mesh_shape, rules=part.rules,
      on_indivisible=part.on_indivisible).cache_bytes_per_device
  if partitioner is None:
    target = sharding.tree_bytes(family.abstract_cache(config, batch, width, max_decode_steps))
  else:
    target = plan(config, partitioner)
  parts = {"target cache": target}
  if draft is not None:
    draft_model = getattr(draft, "model", None)
    if draft_partitioner is not None and draft_model is not None and is_model(draft_model):
      parts["draft state"] = plan(draft_model.config, draft_partitioner)
    else:
      state = jax.eval_shape(
          lambda p, t, n: draft.init_state(p, family.context(t, n), max_decode_steps),
          draft_params, tokens, lengths)
      parts["draft state"] = sharding.tree_bytes(state)
  # The loop's inputs [batch, N] and sequences [batch, N + 1], and the output, int32.
  parts["token buffers"] = 3 * batch * (max_decode_steps + 1) * 4
  return parts


def _build(family: Family, config, draft: Optional[Draft], max_decode_steps: int,
           temperature: float, topk: int, topp: float, eos_id: int, gamma: int,
           block_width: int, verification: str = "token",
           partitioner: Optional[sharding.Partitioner] = None,
           draft_partitioner: Optional[sharding.Partitioner] = None, in_shardings=None):
  # Under a mesh, each model is traced with its own activation axis rules,
  # and caches are pinned to their shardings where they are made and after
  # every model call, so the while-loop carry keeps that layout.
  constrain_target = constrain_draft = lambda state: state  # noqa: E731
  target_axes = draft_axes = contextlib.nullcontext
  if partitioner is not None:
    constrain_target = lambda cache: partitioner.constrain_cache(cache, family)  # noqa: E731
    constrain_draft = lambda state: draft.constrain_state(state, draft_partitioner)  # noqa: E731
    target_axes = partitioner.activation_axes
    draft_axes = draft_partitioner.activation_axes

  trees = draft is not None and draft.proposes_trees
  # A tree writes `block_width` slots past a row's length, whatever its depth:
  # caches get that room past the decode so no node's keys fall off the end.
  room = block_width if trees else 0

  def run(params, draft_params, tokens, lengths, rng):
    with target_axes():
      start = family.start(config, params, tokens, lengths, max_decode_steps + room)
    cache = constrain_target(start.cache)
    block = shift_block_fn(family.block_fn(config, params), start.offset)

    def target_fn(tokens, positions, cache, tree=None):
      family.check_tree(tree)
      with target_axes():
        logits, cache = call_block(block, tokens, positions, cache, tree)
      return logits, constrain_target(cache)

    inputs = jnp.zeros((tokens.shape[0], max_decode_steps), jnp.int32).at[:, 0].set(
        start.first_inputs)
    settings = dict(temperature=temperature, topk=topk, topp=topp, block_width=block_width)
    if draft is None:
      return decoding.decode(inputs, cache, target_fn, eos_id, rng, **settings)
    with draft_axes():
      draft_state = constrain_draft(draft.init_state(
          draft_params, family.context(tokens, lengths),
          max_decode_steps + (draft.room(block_width) if trees else 0)))
    if trees:
      return _tree_decode(family, draft, draft_params, inputs, cache, block, start.offset,
                          draft_state, eos_id, rng, temperature=temperature, topk=topk,
                          topp=topp, block_width=block_width, target_axes=target_axes,
                          draft_axes=draft_axes, constrain_target=constrain_target,
                          constrain_draft=constrain_draft)
    draft_propose = draft.propose_fn(draft_params, gamma, temperature, topk, topp)

    def propose(rng, state, sequences, lengths):
      with draft_axes():
        *proposal, state = draft_propose(rng, state, sequences, lengths)
      return (*proposal, constrain_draft(state))

    return decoding.decode(inputs, cache, target_fn, eos_id, rng, propose_fn=propose,
                           draft_state=draft_state, gamma=gamma, verification=verification,
                           **settings)

  def run_features(params, draft_params, tokens, lengths, rng):
    # A feature draft: the same decode, the target's callbacks also returning its
    # features (`Family.start_features` / `feature_block_fn`), which the loop hands
    # the draft after each verification (`decoding.speculative_sample`'s observe_fn).
    # In a tree (`TreeDraft(FeatureDraft(...))`) the loop hands over the accepted
    # path (`TreeProposer.observe`), up to the tree's depth.
    layers = draft.feature_layers
    with target_axes():
      start, prompt_features, memory = family.start_features(config, params, tokens, lengths,
                                                             max_decode_steps + room, layers)
    cache = constrain_target(start.cache)
    block = shift_block_fn(family.feature_block_fn(config, params, layers), start.offset)

    def target_fn(tokens, positions, cache, tree=None):
      family.check_tree(tree)
      with target_axes():
        logits, features, cache = call_block(block, tokens, positions, cache, tree)
      return logits, features, constrain_target(cache)

    inputs = jnp.zeros((tokens.shape[0], max_decode_steps), jnp.int32).at[:, 0].set(
        start.first_inputs)
    greedy = temperature < sampling.MIN_TEMPERATURE
    with draft_axes():
      draft_state = constrain_draft(draft.init_state(
          draft_params, family.context(tokens, lengths),
          max_decode_steps + (draft.room(block_width) if trees else 0),
          features=prompt_features, memory=memory,
          gamma=draft.max_depth(greedy, block_width) if trees else gamma, start=start))
    if trees:
      return _tree_decode(family, draft, draft_params, inputs, cache, block, start.offset,
                          draft_state, eos_id, rng, temperature=temperature, topk=topk,
                          topp=topp, block_width=block_width, target_axes=target_axes,
                          draft_axes=draft_axes, constrain_target=constrain_target,
                          constrain_draft=constrain_draft, target_fn=target_fn)
    draft_propose = draft.propose_fn(draft_params, gamma, temperature, topk, topp)
    draft_observe = draft.observe_fn(draft_params, gamma)

    def propose(rng, state, sequences, lengths):
      with draft_axes():
        *proposal, state = draft_propose(rng, state, sequences, lengths)
      return (*proposal, constrain_draft(state))

    def observe(state, features, new_tokens, count):
      with draft_axes():
        return constrain_draft(draft_observe(state, features, new_tokens, count))

    return decoding.decode(inputs, cache, target_fn, eos_id, rng, temperature=temperature,
                           topk=topk, topp=topp, block_width=block_width, propose_fn=propose,
                           draft_state=draft_state, gamma=gamma, verification=verification,
                           observe_fn=observe)

  if draft is not None and draft.wants_features:
    run = run_features  # noqa: F811

  if partitioner is None:
    return jax.jit(run)
  return jax.jit(run, in_shardings=in_shardings, out_shardings=partitioner.replicated())


def _tree_decode(family, draft, draft_params, inputs, cache, block, offset, draft_state, eos_id,
                 rng, *, temperature, topk, topp, block_width, target_axes, draft_axes,
                 constrain_target, constrain_draft, target_fn=None):
  """`_build`'s decode with a tree draft: `tree_decoding.tree_sample` on the same callbacks
  (target_fn: the target's tree callback when it is not `block`'s, e.g. one that also
  returns features for a feature draft)."""
  proposer = draft.tree_proposer(draft_params, temperature, topk, topp, block_width)

  if target_fn is None:
    def target_fn(tokens, positions, cache, tree):
      with target_axes():
        logits, cache = call_block(block, tokens, positions, cache, tree)
      return logits, constrain_target(cache)

  def move(cache, positions, sources):
    return constrain_target(family.move_cache(cache, positions + offset, sources))

  def propose(*args):
    with draft_axes():
      tree, state = proposer.propose(*args)
    return tree, constrain_draft(state)

  def accept(*args):
    with draft_axes():
      return constrain_draft(proposer.accept(*args))

  def init(*args):
    return constrain_draft(proposer.init(*args))

  observe = None
  if proposer.observe is not None:
    def observe(*args):
      with draft_axes():
        return constrain_draft(proposer.observe(*args))

  return tree_decoding.tree_sample(
      inputs, cache, target_fn, move,
      proposer._replace(init=init, propose=propose, accept=accept, observe=observe),
      draft_state, eos_id, decode_rng=rng, temperature=temperature, topk=topk, topp=topp)


def generate(model, inputs, prompt_lengths=None, *, max_decode_steps: int,
             temperature: float = 0.0,
             topk: int = 0, topp: float = 0.0, eos_id: Optional[int] = None,
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
      every row is C long). T5 takes none.
    max_decode_steps: tokens to generate per row (>= 1).
    temperature / topk / topp: sampling (temperature 0 = greedy); the draft is
      adjusted the same way, so outputs are distributed exactly as without it.
    eos_id: defaults to the model's (a model without one never stops early).
    rng: PRNG key (default PRNGKey(0)).
    draft: a smaller model of the target's family, or any
      `specdec_jax.drafts.Draft` (n-gram, prompt lookup, adaptive, ...). A
      `TreeDraft` / `DynamicTreeDraft` proposes a token tree each iteration,
      scored in one block of block_width slots (>= its `num_nodes`; default
      on CPU float32: its num_nodes) and verified by recursive rejection
      sampling (`core.tree_decoding`); gamma is then unused.
    gamma: tokens drafted per iteration.
    verification: how drafts are kept (`decoding.VERIFIERS`): "token"
      (Leviathan et al.: up to the first rejection) or "block" (Sun et al.
      2025: the optimal block rule, `core.block_verification`; same output
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
      batch sizes round differently: see BENCHMARKS.md). Costs the batch's
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
      concatenated in process order (`sharding.global_batch`), decoded as
      one batch of P * b rows on the partitioner's mesh, which must span
      every process. Returns this process's rows of the outputs
      (`sharding.process_row_block(b)` of the global ones; gather them with
      `sharding.gather_rows` for one writer, or pass global_outputs).
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
  if int(max_decode_steps) != max_decode_steps or max_decode_steps < 1:
    raise ValueError(f"max_decode_steps must be an int >= 1, got {max_decode_steps!r}")
  max_decode_steps = int(max_decode_steps)
  decoding.check_verification(verification)
  if draft is None and verification != "token":
    raise ValueError(f"verification={verification!r} applies to speculative decoding; "
                     "pass a draft")
  if batch_invariant:
    if process_local:
      raise ValueError("batch_invariant decodes rows one at a time on one device; it does not "
                       "take process_local (drop one of them)")
    return _generate_rows(model, inputs, prompt_lengths, max_decode_steps=max_decode_steps,
                          temperature=temperature, topk=topk, topp=topp, eos_id=eos_id,
                          rng=rng, draft=draft, gamma=gamma, verification=verification,
                          block_width=block_width,
                          matmul_precision=matmul_precision, partitioner=partitioner,
                          draft_partitioner=draft_partitioner)
  config = model.config
  tokens, lengths = family.check_inputs(config, inputs, prompt_lengths, max_decode_steps)
  sampling.validate_sampling(temperature, topk, topp, config.vocab_size)
  eos_id = family.eos_id(config) if eos_id is None else int(eos_id)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  draft_obj = None
  if draft is not None:
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
      raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
    draft_obj = as_draft(draft)
    draft_obj.check_compatible(config)
    draft_obj.check_inputs(inputs, prompt_lengths, max_decode_steps)
  gamma = int(gamma) if draft_obj is not None else 0
  platform = (None if partitioner is None else
              np.asarray(partitioner.mesh.devices).flat[0].platform)
  trees = draft_obj is not None and draft_obj.proposes_trees
  if trees:
    family.check_tree(draft_obj)
    if verification != "token":
      raise ValueError(f"verification={verification!r} verifies a chain; a {type(draft_obj).__name__} "
                       "is verified by recursive rejection sampling over its tree (its children's "
                       "law): drop verification, or use a chain draft")
    # A tree's block holds its slots; the draft checks they fit (naming the width).
    width = decoding.resolve_block_width(
        block_width if block_width is not None else
        draft_obj.num_nodes if decoding.narrow_by_default(config.dtype, platform) else None)
    gamma = draft_obj.max_depth(temperature < sampling.MIN_TEMPERATURE, width)
    draft_obj.tree_proposer(draft_obj.params, temperature, topk, topp, width)
  else:
    width = decoding.resolve_block_width(block_width, gamma if draft_obj is not None else None,
                                         dtype=config.dtype, platform=platform)
  precision = check_matmul_precision(matmul_precision)
  statics = (max_decode_steps, float(temperature), int(topk), float(topp), eos_id, gamma, width,
             verification)
  key = (config, None if draft_obj is None else draft_obj.static_key(), precision) + statics
  params = model.params
  draft_params = None if draft_obj is None else draft_obj.params
  # Per-host rows on several processes: `tokens` / `lengths` are this
  # process's b rows of a global batch of P * b (checked locally above).
  local_batch = tokens.shape[0]
  per_host = process_local and jax.process_count() > 1
  if per_host and (partitioner is None or not sharding.spans_processes(partitioner.replicated())):
    raise ValueError(f"process_local=True on {jax.process_count()} processes needs a partitioner "
                     "whose mesh spans every process (sharding.make_partitioners over all "
                     "devices); without one, each process would decode its rows alone")
  global_shape = ((jax.process_count() * local_batch,) + tuple(tokens.shape[1:]) if per_host
                  else tuple(tokens.shape))
  args = (params, draft_params, tokens, lengths, rng)
  shard_kwargs = {}
  multihost = False
  if partitioner is not None:
    if draft_partitioner is None:
      draft_partitioner = partitioner.replace(rules=sharding.DRAFT_RULES)
    if draft_partitioner.mesh != partitioner.mesh:
      raise ValueError("target and draft partitioners must share one mesh (rules may differ)")
    key += (partitioner, draft_partitioner)
    in_shardings = (partitioner.param_shardings(params, family),
                    None if draft_obj is None else draft_obj.param_shardings(draft_partitioner),
                    partitioner.batch_sharding(global_shape, "inputs"),
                    partitioner.batch_sharding(global_shape[:1], "prompt_lengths"),
                    partitioner.replicated())
    multihost = sharding.spans_processes(partitioner.replicated())
    if multihost:
      key_data = jax.random.key_data(rng) if sharding.is_key_array(rng) else rng
      if per_host:
        # Rows differ by design; the rng and the local shapes must not.
        sharding.assert_same_on_every_process(
            dict(rng=key_data, local_inputs_shape=np.array(tokens.shape)),
            "with process_local=True every process passes its own rows, the same number "
            "of the same width (pad the last batch), and the same rng and settings")
        tokens, lengths = sharding.global_batch(partitioner, tokens, lengths,
                                                check_shapes=False)
        args = (params, draft_params, tokens, lengths, rng)
      else:
        # Each process holds the global batch on the host; a mismatch between
        # processes would decode the wrong rows, so it is an error.
        sharding.assert_same_on_every_process(
            dict(inputs=tokens, prompt_lengths=lengths, rng=key_data))
    # A no-op for arrays already laid out this way; on several processes each
    # process places only its own devices' slices of host data.
    args = sharding.put(args, in_shardings)
    shard_kwargs = dict(partitioner=partitioner, draft_partitioner=draft_partitioner,
                        in_shardings=in_shardings)
  # Before anything is allocated: a cache that cannot fit is an error naming
  # its bytes, not an allocation that fails (or swaps) part way.
  memory_key = key + (global_shape,)
  if memory_key not in _MEMORY:
    abstract_tokens = jax.ShapeDtypeStruct(global_shape, jnp.int32)
    abstract_lengths = jax.ShapeDtypeStruct(global_shape[:1], jnp.int32)
    _MEMORY[memory_key] = _decode_memory(family, config, draft_obj, draft_params,
                                         abstract_tokens, abstract_lengths,
                                         max_decode_steps + (draft_obj.room(width) if trees
                                                             else 0),
                                         partitioner, draft_partitioner)
  devices = (list(np.asarray(partitioner.mesh.devices).flat) if partitioner is not None else
             jax.local_devices()[:1])
  sharding.check_decode_memory(_MEMORY[memory_key], devices,
                               f"max_decode_steps={max_decode_steps} at batch {global_shape[0]}")
  with _COMPILED_LOCK:
    if key not in _COMPILED:
      _COMPILED[key] = _build(family, config, draft_obj, *statics, **shard_kwargs)
    fn = _COMPILED[key]
  with matmul_precision_scope(precision):
    sequences, stats = fn(*args)
  if multihost:
    # Outputs are replicated: every process reads them locally from here on.
    sequences, stats = sharding.local_copy((sequences, stats))
  output = make_output(sequences, stats, eos_id, gamma)
  if per_host and not global_outputs:
    output = _process_rows(output, local_batch)
  return output


def _process_rows(output: GenerateOutput, local_batch: int) -> GenerateOutput:
  """This process's block of rows of replicated outputs (every per-row field)."""
  block = sharding.process_row_block(local_batch)
  stats = output.stats
  if stats is not None:
    stats = dataclasses.replace(stats, **{
        f.name: getattr(stats, f.name)[block] for f in dataclasses.fields(stats)
        if f.name != "gamma" and getattr(stats, f.name) is not None})
  return GenerateOutput(output.sequences[block], output.lengths[block], stats)


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
