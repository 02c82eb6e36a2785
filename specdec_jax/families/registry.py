"""The registry of model families: the one place that knows every family.

`family_of(model_or_config)` is how the engine finds the family of what it
was given; a new family calls `register(family)` once (the built-in T5 and
decoder-only families are registered here).
"""

from typing import Any, List, Optional, Tuple

from specdec_jax.families.base import Family
from specdec_jax.families.decoder_only.family import FAMILY as DECODER_ONLY
from specdec_jax.families.t5.family import FAMILY as T5

_FAMILIES: List[Family] = [T5, DECODER_ONLY]


def register(family: Family) -> Family:
  """Adds `family` (an instance of a `Family` subclass); returns it. Idempotent."""
  if not isinstance(family, Family):
    raise TypeError(f"register takes a specdec_jax.families.base.Family, got "
                    f"{type(family).__name__}")
  for known in _FAMILIES:
    if known is family:
      return family
    if known.config_type is family.config_type:
      raise ValueError(f"config type {family.config_type.__name__} already belongs to family "
                       f"{known.name!r}")
  _FAMILIES.append(family)
  return family


def families() -> Tuple[Family, ...]:
  return tuple(_FAMILIES)


def _config_of(obj) -> Any:
  return getattr(obj, "config", obj)


def find_family(obj) -> Optional[Family]:
  """The family of a model (anything with `.config`) or a config, or None."""
  config_type = type(_config_of(obj))
  for family in _FAMILIES:
    if config_type is family.config_type:
      return family
  return None


def family_of(obj) -> Family:
  """The family of a model or config. Raises TypeError naming the known model types."""
  family = find_family(obj)
  if family is None:
    known = ", ".join(f"{f.model_type.__name__} ({f.name})" for f in _FAMILIES)
    raise TypeError(f"{type(obj).__name__} is not a model of a registered family; known: "
                    f"{known}")
  return family


def is_model(obj) -> bool:
  """Whether `obj` is a model (config + params) of a registered family."""
  family = find_family(obj)
  return family is not None and isinstance(obj, family.model_type)


def supported_architectures() -> str:
  """Every checkpoint architecture of every family, for error messages."""
  return "; ".join(f"{f.name}: {', '.join(f.architectures)}" for f in _FAMILIES)
