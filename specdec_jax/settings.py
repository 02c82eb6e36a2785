"""The validated settings of one decode: what `generate`, the T5X model and the launcher share.

Each check lives here once, raises ValueError naming the setting and the fix,
and runs on the host before any work. `DecodeSettings` is the whole static
plan of a decode; equal settings share a compiled program.

    settings = plan_settings(target.config, draft, max_decode_steps=64, temperature=0.0,
                             gamma=4)
    settings.sampling.greedy, settings.gamma, settings.block_width
"""

import dataclasses
import threading
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import decoding
from specdec_jax.core.sampling import MIN_TEMPERATURE, Sampling
from specdec_jax.core.tree_decoding import TreeProposer
from specdec_jax.drafts import Draft, DraftStart, ProposalPlan, as_draft
from specdec_jax.families.registry import family_of


# Keys of the warnings `warn_once` has given in this process.
_WARNED = set()
_WARNED_LOCK = threading.Lock()


def warn_once(key: str, message: str) -> None:
  """`warnings.warn(message)` the first time `key` is seen in this process: a
  setting that is legal but probably not meant is worth one line, not one per
  call of a loop."""
  with _WARNED_LOCK:
    if key in _WARNED:
      return
    _WARNED.add(key)
  warnings.warn(message, UserWarning, stacklevel=3)


def sampled(temperature) -> bool:
  """Whether `temperature` samples (>= MIN_TEMPERATURE); False for greedy and for values
  that `Sampling` will reject by name."""
  try:
    return float(temperature) >= MIN_TEMPERATURE
  except (TypeError, ValueError):
    return False


def check_steps(max_decode_steps) -> int:
  """max_decode_steps as an int >= 1, else ValueError."""
  if (isinstance(max_decode_steps, bool) or int(max_decode_steps) != max_decode_steps or
      max_decode_steps < 1):
    raise ValueError(f"max_decode_steps must be an int >= 1, got {max_decode_steps!r}")
  return int(max_decode_steps)


def check_gamma(gamma) -> int:
  """gamma as an int >= 1, else ValueError."""
  if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
    raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
  return int(gamma)


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """Every static choice of one decode, validated together.

  max_decode_steps: tokens per row (None: the caller's decode length, T5X's).
  sampling: the adjustment shared by target and draft (`Sampling`, `.greedy`).
  eos_id: the end-of-sequence id (the model's unless overridden).
  gamma: 0 without a draft; a chain's tokens per proposal; a tree's deepest
    node (`Draft.proposal_depth`).
  block_width: W, the width of every target call in both loops.
  verification: the chain rule's name (`core.verification.VERIFIERS`).
  """
  max_decode_steps: Optional[int]
  sampling: Sampling
  eos_id: int
  gamma: int
  block_width: int
  verification: str = "token"


def plan_settings(config, draft: Optional[Draft], *, max_decode_steps, temperature=0.0, topk=0,
                  topp=None, eos_id: Optional[int] = None, gamma=4, verification: str = "token",
                  block_width: Optional[int] = None, platform: Optional[str] = None
                  ) -> DecodeSettings:
  """Validates a decode's settings for a target of `config` and a `Draft` (or None).

  The block width follows `decoding.resolve_block_width`: given, or the
  draft's slots on CPU float32, else DEFAULT_BLOCK_WIDTH; a proposal wider
  than it is an error naming the width to pass (the draft's words,
  `Draft.describe_slots`). `platform`: the devices' ('cpu', 'gpu', 'tpu';
  default: JAX's backend). topp: None for no top-p filtering, else a mass in
  (0, 1]; an explicit 0 still means none, with a warning once per process
  when sampling (it reads like "keep nothing").
  """
  family = family_of(config)
  steps = None if max_decode_steps is None else check_steps(max_decode_steps)
  decoding.check_verification(verification)
  sampling = Sampling(temperature, topk, topp).check_vocab(config.vocab_size)
  if topp is not None and float(topp) == 0.0 and not sampling.greedy:
    warn_once("topp=0", "topp=0 is read as no top-p filtering; pass topp=None for that, or a "
              "mass in (0, 1]")
  eos = family.eos_id(config) if eos_id is None else int(eos_id)
  if draft is None:
    if verification != "token":
      raise ValueError(f"verification={verification!r} applies to speculative decoding; "
                       "pass a draft")
    width = decoding.resolve_block_width(block_width, dtype=config.dtype, platform=platform)
    return DecodeSettings(steps, sampling, eos, 0, width, verification)
  gamma = check_gamma(gamma)
  draft.check_verification(verification)
  width = decoding.resolve_block_width(
      block_width, dtype=config.dtype, platform=platform, slots=draft.block_slots(gamma),
      what=draft.describe_slots(gamma))
  depth = draft.proposal_depth(sampling, gamma, width)
  return DecodeSettings(steps, sampling, eos, depth, width, verification)


def check_draft(config, draft, inputs, prompt_lengths, max_decode_steps: int,
                row_keys: bool = False) -> Draft:
  """The `Draft` for `draft` (a model is wrapped), checked against the target before any
  work: its vocabulary and token ids, what it reads from the target (the family must serve
  it), and its own limits on the inputs; with `row_keys` (the slots: `generate_many`, the
  launcher's default scheduling), that its proposer takes one key per row
  (`check_row_keys`). `generate` hands one key, so a draft of one key still serves it."""
  draft = as_draft(draft)
  draft.check_compatible(config)
  draft.reads.check_served(family_of(config), config)
  draft.check_inputs(inputs, prompt_lengths, max_decode_steps)
  if row_keys:
    check_row_keys(config, draft, inputs, max_decode_steps)
  return draft


# What `check_row_keys` found, by draft (`compile_key`) and the shapes it asked about:
# each draft is traced once per shape in a process, not once per call.
_ROW_KEYS_CHECKED = {}
_ROW_KEYS_LOCK = threading.Lock()
# The gamma a draft is probed at (or its most, when smaller): the failure this check
# looks for is in how keys are split, which any gamma >= 2 reaches.
_PROBE_GAMMA = 2


def row_keys_fix(name: str) -> str:
  """The words of `check_row_keys`' error: what the draft was given, and the fix."""
  return (f"{name}'s proposer cannot take one key per row: sj.generate_many and the "
          "launcher's slots hand propose rng = row keys, shape (batch, 2) (one key per "
          "row, so an input's draws never depend on the rows beside it; generate hands "
          "it one key, shape (2,)). Split rng with "
          "specdec_jax.core.sampling.split_keys(rng, n) (keys[i] is a key, or row keys: "
          "each row's own split) and draw with plan.sampling.draw(keys[i], probs), not "
          "jax.random.split(rng, n) / jax.random.categorical(rng, ...) (docs/drafts.md)")


def check_row_keys(config, draft: Draft, inputs, max_decode_steps: int) -> None:
  """Raises ValueError naming the draft when its proposer traces with one key but not
  with one key per row (what `generate_many` and the launcher's slots pass), before
  anything compiles: `jax.eval_shape` of init_state and one proposal, at temperature 1
  (the draws use the keys), gamma 2. A draft that fails with both keys is left to the
  decode's own errors (its reads or settings may need what a shape query lacks)."""
  batch = int(np.shape(inputs)[0])
  shapes = (jax.ShapeDtypeStruct(tuple(np.shape(inputs)), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
  try:
    key = (draft.compile_key(), type(config), np.shape(inputs), int(max_decode_steps))
    hash(key)
  except TypeError:  # an unhashable static key: checked every call
    key = None
  with _ROW_KEYS_LOCK:
    error = _ROW_KEYS_CHECKED.get(key, False) if key is not None else False
  if error is False:
    rows = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    error = _probe_proposal(config, draft, shapes, max_decode_steps, rows)
    if error is not None and _probe_proposal(config, draft, shapes, max_decode_steps,
                                             jax.ShapeDtypeStruct((2,), jnp.uint32)):
      error = None  # one key fails too: not a row-key problem
    if key is not None:
      with _ROW_KEYS_LOCK:
        _ROW_KEYS_CHECKED[key] = error
  if error is not None:
    raise ValueError(f"{row_keys_fix(_draft_name(draft))}; given row keys of shape "
                     f"({batch}, 2), it raised {error}")


def _draft_name(draft: Draft) -> str:
  """The draft's class, with the drafts it wraps (AdaptiveGammaDraft(MyDraft))."""
  inner = getattr(draft, "inner", None) or getattr(draft, "draft", None)
  name = type(draft).__name__
  return f"{name}({_draft_name(inner)})" if isinstance(inner, Draft) else name


def _probe_proposal(config, draft: Draft, shapes, steps: int, rng) -> Optional[str]:
  """None when init_state and one proposal trace (`jax.eval_shape`: no compile) with
  `rng`, else the first line of what they raised."""
  gamma = min(_PROBE_GAMMA, draft.max_gamma or _PROBE_GAMMA)
  family = family_of(config)

  def propose(params, tokens, lengths, rng):
    settings = plan_settings(config, draft, max_decode_steps=steps, temperature=1.0,
                             gamma=gamma, block_width=draft.block_slots(gamma))
    plan = ProposalPlan(settings.sampling, settings.gamma, settings.block_width)
    state = draft.init_state(params, DraftStart(
        family.context(tokens, lengths), steps + draft.room(plan.block_width), plan.gamma))
    proposer = draft.proposer(params, plan)
    sequences = jnp.zeros((tokens.shape[0], steps + 1), jnp.int32)
    at = jnp.zeros_like(lengths)
    if isinstance(proposer, TreeProposer):
      state = proposer.init(state, tokens.shape[0])
      pending = jnp.zeros((tokens.shape[0], proposer.max_depth), jnp.int32)
      return proposer.propose(rng, state, sequences, at, pending, at)
    return proposer.propose(rng, state, sequences, at)

  try:
    jax.eval_shape(propose, draft.params, *shapes, rng)
  except Exception as e:  # noqa: BLE001 (any failure is what the caller weighs)
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
  return None


def platform_of(partitioner) -> Optional[str]:
  """The platform of a partitioner's devices (None without one: JAX's backend)."""
  if partitioner is None:
    return None
  return np.asarray(partitioner.mesh.devices).flat[0].platform

