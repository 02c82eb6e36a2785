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

import numpy as np

from specdec_jax.core import decoding
from specdec_jax.core.sampling import MIN_TEMPERATURE, Sampling
from specdec_jax.drafts import Draft, as_draft
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


def check_draft(config, draft, inputs, prompt_lengths, max_decode_steps: int) -> Draft:
  """The `Draft` for `draft` (a model is wrapped), checked against the target before any
  work: its vocabulary and token ids, what it reads from the target (the family must serve
  it), and its own limits on the inputs."""
  draft = as_draft(draft)
  draft.check_compatible(config)
  draft.reads.check_served(family_of(config), config)
  draft.check_inputs(inputs, prompt_lengths, max_decode_steps)
  return draft


def platform_of(partitioner) -> Optional[str]:
  """The platform of a partitioner's devices (None without one: JAX's backend)."""
  if partitioner is None:
    return None
  return np.asarray(partitioner.mesh.devices).flat[0].platform

