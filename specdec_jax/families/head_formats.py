"""The registry of draft-head checkpoint formats: the one place that knows every format.

A format is a public layout of trained draft heads (EAGLE-1, EAGLE-3,
Medusa-1 directories). Each registers itself once (`register_head_format`)
from the code that owns it: the decoder-only family registers EAGLE-1 and
EAGLE-3 (`families/decoder_only/eagle_checkpoints.py`), the Medusa draft's
reader registers Medusa-1 (`drafts/medusa_checkpoints.py`). The loaders
(`loading.load_feature_draft`, `load_medusa_draft` and their `save_*`) find
a format here by name or by detection and never name one themselves.

Formats are grouped by the draft they hold (`HeadFormat.kind`): 'feature'
(a `FeatureDraft`'s head), 'medusa' (a `MedusaDraft`'s heads) or 'dflash' (a
`DFlashDraft`'s layers: z-lab's format, `drafts/dflash_checkpoints.py`). This module
builds no draft and imports no family: it reads a target's family from the
caller, so the registry of families and the families themselves may import it.
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from specdec_jax.families.base import Family
from specdec_jax.families.tensor_io import CheckpointError

KINDS = ("feature", "medusa", "dflash")


class UnsupportedHeadFormat(CheckpointError):
  """No registered head format reads these heads for this target."""


@dataclasses.dataclass(frozen=True, eq=False)
class HeadFormat:
  """A checkpoint format of draft heads.

  Attributes:
    name: the format's name ('eagle1', 'eagle3', 'medusa1'); unique.
    kind: the draft it holds: 'feature' or 'medusa' (`KINDS`).
    families: names of the target families whose heads it holds; None: every
      family that exposes its hidden states (`Family.supports_features`).
    targets: the targets it serves, in words, for error messages ("decoder-only
      Llama-layout targets").
    detect: (path) -> bool, whether the directory holds heads of this format
      (reads config.json and tensor names at most; never raises).
    load: (path, target model, dtype or None) -> the keyword arguments of the
      kind's draft besides the target ('feature': head, head_params; 'medusa':
      num_heads, num_layers, params). Raises CheckpointError naming the file,
      tensor or key at fault.
    save: (draft, path) -> None: writes a draft of the kind in this format.
    writes: (draft) -> bool, whether `save` writes this draft.
    diagnose: (path) -> None, raises CheckpointError saying why the path holds
      no heads of this format (missing directory, config or weights); called
      when no format detects a path. None: nothing more to say.
  """
  name: str
  kind: str
  families: Optional[Tuple[str, ...]]
  targets: str
  detect: Callable[[str], bool]
  load: Callable[..., Dict[str, Any]]
  save: Callable[[Any, str], None]
  writes: Callable[[Any], bool] = lambda draft: True
  diagnose: Optional[Callable[[str], None]] = None

  def serves(self, family: Family) -> bool:
    """Whether heads in this format draft for targets of `family`."""
    if self.families is None:
      return bool(family.supports_features)
    return family.name in self.families

  def describe(self) -> str:
    """'eagle3 (decoder_only)', 'medusa1 (any family with features)'."""
    families = ("any family with features" if self.families is None
                else ", ".join(self.families))
    return f"{self.name} ({families})"


_FORMATS: List[HeadFormat] = []


def register_head_format(fmt: HeadFormat) -> HeadFormat:
  """Adds `fmt`; returns it. Idempotent for the same object; another format of the same
  name is a ValueError."""
  if not isinstance(fmt, HeadFormat):
    raise TypeError(f"register_head_format takes a HeadFormat, got {type(fmt).__name__}")
  if fmt.kind not in KINDS:
    raise ValueError(f"head format {fmt.name!r}: kind must be one of {KINDS}, got {fmt.kind!r}")
  for known in _FORMATS:
    if known is fmt:
      return fmt
    if known.name == fmt.name:
      raise ValueError(f"a head format named {fmt.name!r} is already registered")
  _FORMATS.append(fmt)
  return fmt


def head_formats(kind: Optional[str] = None) -> Tuple[HeadFormat, ...]:
  """The registered formats (of `kind` when given), in registration order."""
  return tuple(f for f in _FORMATS if kind is None or f.kind == kind)


def _listed(kind: str) -> str:
  return ", ".join(f.describe() for f in head_formats(kind)) or "none"


def get_head_format(name: str, kind: Optional[str] = None) -> HeadFormat:
  """The format called `name` (of `kind` when given). ValueError naming the formats."""
  for fmt in head_formats(kind):
    if fmt.name == name:
      return fmt
  names = tuple(f.name for f in head_formats(kind))
  raise ValueError(f"format must be one of {names}, got {name!r}")


def _unserved(kind: str, family: Family, target_config, where: str) -> UnsupportedHeadFormat:
  groups: Dict[str, List[str]] = {}
  for fmt in head_formats(kind):
    groups.setdefault(fmt.targets, []).append(fmt.name)
  served = "; ".join(f"{', '.join(names)} read{'s' if len(names) == 1 else ''} heads for "
                     f"{targets}" for targets, names in groups.items())
  return UnsupportedHeadFormat(
      f"{where}no registered {kind}-head format serves the {family.name} family: "
      f"{served or 'none is registered'}; the target is a {type(target_config).__name__} "
      f"model (registered {kind}-head formats and their families: {_listed(kind)})")


def find_head_format(path: str, kind: str, family: Family, target_config,
                     name: Optional[str] = None) -> HeadFormat:
  """The format of `kind` that reads `path` for a target of `family`.

  `name` picks a format outright; otherwise the first format that serves the
  family and detects the path. Raises UnsupportedHeadFormat when no format of
  `kind` serves the family (naming the formats and their families), and a
  CheckpointError saying what the path lacks when none detects it.
  """
  where = f"{path}: " if path is not None else ""
  serving = [f for f in head_formats(kind) if f.serves(family)]
  if name is not None:
    fmt = get_head_format(name, kind)
    if fmt not in serving:
      raise _unserved(kind, family, target_config, where)
    return fmt
  if not serving:
    raise _unserved(kind, family, target_config, where)
  for fmt in serving:
    if fmt.detect(path):
      return fmt
  for fmt in serving:
    if fmt.diagnose is not None:
      fmt.diagnose(path)
  raise UnsupportedHeadFormat(f"{where}no registered {kind}-head format recognises these "
                              f"heads; formats serving the {family.name} family: "
                              f"{', '.join(f.describe() for f in serving)}")


def head_format_for(draft, kind: str, name: Optional[str] = None) -> HeadFormat:
  """The format that writes `draft` (a draft of `kind`): `name`'s, which must write it,
  or else the first registered format of `kind` that does. ValueError otherwise."""
  writers = [f for f in head_formats(kind) if f.writes(draft)]
  what = f"this {type(draft).__name__}"
  if getattr(draft, "head", None) is not None:
    what += f" (a {type(draft.head).__name__})"
  if name is not None:
    fmt = get_head_format(name, kind)
    if fmt not in writers:
      raise ValueError(f"{what} cannot be written as {name}; the {kind}-head formats that "
                       f"write it: {', '.join(f.name for f in writers) or 'none'}")
    return fmt
  if not writers:
    raise ValueError(f"no registered {kind}-head format writes {what}; registered: "
                     f"{_listed(kind)}")
  return writers[0]
