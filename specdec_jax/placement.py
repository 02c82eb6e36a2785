"""Where a decode's arrays live: one device, or a partitioner's mesh over one or more processes.

`plan_placement` checks the partitioners and per-host rows before any work and
returns a `Placement`, which `generate` uses at three points:

    args = placement.place(args)          params, inputs and key on their devices
    fn = placement.jit(run)               jit with the mesh's in/out shardings
    output = placement.finish(output)     replicated outputs read locally; per-host rows

and `programs.build_program` uses its `scopes` (activation axis rules and cache
layouts for target and draft). Without a partitioner every one of these is the
identity.
"""

import contextlib
import dataclasses
from typing import Any, Optional, Tuple

import jax
import numpy as np

from specdec_jax import multihost
from specdec_jax import sharding
from specdec_jax.core.outputs import GenerateOutput

_identity = lambda tree: tree  # noqa: E731


@dataclasses.dataclass(frozen=True)
class Placement:
  """One decode's layout.

  partitioner / draft_partitioner: the target's and the draft's rules on
    one mesh (None: one device).
  global_shape: (batch, C) of the whole decode (every process's rows).
  local_batch: this process's rows (== batch unless per_host).
  per_host: `process_local` rows on several processes.
  multihost: the mesh spans several processes.
  in_shardings: jit's argument shardings (params, draft params, tokens,
    lengths, rng), or None.
  """
  partitioner: Optional[sharding.Partitioner] = None
  draft_partitioner: Optional[sharding.Partitioner] = None
  global_shape: Tuple[int, ...] = ()
  local_batch: int = 0
  per_host: bool = False
  multihost: bool = False
  in_shardings: Any = None

  @property
  def key(self) -> Tuple:
    """What a compiled program depends on."""
    return (() if self.partitioner is None else (self.partitioner, self.draft_partitioner))

  @property
  def devices(self) -> list:
    if self.partitioner is None:
      return jax.local_devices()[:1]
    return list(np.asarray(self.partitioner.mesh.devices).flat)

  def scopes(self, family, draft):
    """(target_scope, constrain_target, draft_scope, constrain_draft): context managers
    for tracing each model under its activation axis rules, and functions that pin the
    target's cache / the draft's state to their layouts (so the while-loop carry keeps
    them)."""
    if self.partitioner is None:
      return contextlib.nullcontext, _identity, contextlib.nullcontext, _identity
    part, draft_part = self.partitioner, self.draft_partitioner
    constrain_draft = (_identity if draft is None else
                       lambda state: draft.constrain_state(state, draft_part))
    return (part.activation_axes, lambda cache: part.constrain_cache(cache, family),
            draft_part.activation_axes, constrain_draft)

  def place(self, args):
    """The program's arguments on their devices (a no-op for arrays already laid out so;
    on several processes each places only its own devices' slices)."""
    if self.partitioner is None:
      return args
    return multihost.put(args, self.in_shardings)

  def jit(self, run):
    if self.partitioner is None:
      return jax.jit(run)
    return jax.jit(run, in_shardings=self.in_shardings,
                   out_shardings=self.partitioner.replicated())

  def read_back(self, outputs):
    """The program's replicated outputs, readable on this process."""
    return multihost.local_copy(outputs) if self.multihost else outputs

  def finish(self, output: GenerateOutput, global_outputs: bool) -> GenerateOutput:
    """This process's rows of the output (per-host rows, unless global_outputs)."""
    if not self.per_host or global_outputs:
      return output
    block = multihost.process_row_block(self.local_batch)
    stats = output.stats
    if stats is not None:
      stats = dataclasses.replace(stats, **{
          f.name: getattr(stats, f.name)[block] for f in dataclasses.fields(stats)
          if f.name != "gamma" and getattr(stats, f.name) is not None})
    return GenerateOutput(output.sequences[block], output.lengths[block], stats)


def plan_placement(family, draft, params, tokens, lengths, rng, *,
                   partitioner: Optional[sharding.Partitioner],
                   draft_partitioner: Optional[sharding.Partitioner],
                   process_local: bool) -> Tuple[Placement, Tuple[Any, ...]]:
  """The decode's `Placement` and its program arguments (params, draft params, tokens
  [batch, C], lengths [batch], rng), checked on the host before any work.

  With process_local on several processes, `tokens` / `lengths` are this
  process's rows of a global batch; the arguments become the global batch.
  On several processes, inputs and rng must agree between processes (an
  error names what differs).
  """
  draft_params = None if draft is None else draft.params
  local_batch = tokens.shape[0]
  per_host = process_local and jax.process_count() > 1
  if per_host and (partitioner is None or
                   not multihost.spans_processes(partitioner.replicated())):
    raise ValueError(f"process_local=True on {jax.process_count()} processes needs a partitioner "
                     "whose mesh spans every process (sharding.make_partitioners over all "
                     "devices); without one, each process would decode its rows alone")
  global_shape = ((jax.process_count() * local_batch,) + tuple(tokens.shape[1:]) if per_host
                  else tuple(tokens.shape))
  args = (params, draft_params, tokens, lengths, rng)
  if partitioner is None:
    return Placement(global_shape=global_shape, local_batch=local_batch), args
  if draft_partitioner is None:
    draft_partitioner = partitioner.replace(rules=sharding.DRAFT_RULES)
  if draft_partitioner.mesh != partitioner.mesh:
    raise ValueError("target and draft partitioners must share one mesh (rules may differ)")
  in_shardings = (partitioner.param_shardings(params, family),
                  None if draft is None else draft.param_shardings(draft_partitioner),
                  partitioner.batch_sharding(global_shape, "inputs"),
                  partitioner.batch_sharding(global_shape[:1], "prompt_lengths"),
                  partitioner.replicated())
  spans = multihost.spans_processes(partitioner.replicated())
  if spans:
    key_data = jax.random.key_data(rng) if multihost.is_key_array(rng) else rng
    if per_host:
      # Rows differ by design; the rng and the local shapes must not.
      multihost.assert_same_on_every_process(
          dict(rng=key_data, local_inputs_shape=np.array(tokens.shape)),
          "with process_local=True every process passes its own rows, the same number "
          "of the same width (pad the last batch), and the same rng and settings")
      tokens, lengths = multihost.global_batch(partitioner, tokens, lengths, check_shapes=False)
      args = (params, draft_params, tokens, lengths, rng)
    else:
      # Each process holds the global batch on the host; a mismatch between
      # processes would decode the wrong rows, so it is an error.
      multihost.assert_same_on_every_process(
          dict(inputs=tokens, prompt_lengths=lengths, rng=key_data))
  placement = Placement(partitioner, draft_partitioner, global_shape, local_batch, per_host,
                        spans, in_shardings)
  return placement, args
