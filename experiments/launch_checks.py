"""Checks of a launch that need no weights: every problem found together, in plain words.

An experiment entry point parses its gin files and bindings, then asks these
checks before it loads anything. Each problem is one line naming the setting
and the flag that fixes it; `LaunchError` carries them all, so a run with
three mistakes is fixed in one edit, not three relaunches.

- `binding_problems`: each `--gin.NAME=VALUE` on its own: a value gin cannot
  read (a string without quotes), an unknown configurable or parameter (with
  the nearest known name).
- `config_problems`: the parsed configuration as a whole, walked from the
  root configurable along its references: settings still %gin.REQUIRED,
  required parameters left unbound, and user settings nothing reads (a typo,
  GAMA for GAMMA, or a setting of a gin file this run does not load).
- `output_dir_problem`: the output directory can be created and written (a
  test file), probed before hours of decoding, not after.
"""

import ast
import difflib
import glob
import inspect
import os
import re
import uuid
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import gin
from gin import config as gin_config

_MACRO_DEFINITION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=", re.M)


class LaunchError(ValueError):
  """Every problem a launch check found; nothing was loaded or written."""

  def __init__(self, problems: Sequence[str]):
    self.problems = list(problems)
    if len(self.problems) == 1:
      message = self.problems[0]
    else:
      message = (f"{len(self.problems)} problems (nothing was loaded or written):\n"
                 + "\n".join(f"  - {p}" for p in self.problems))
    super().__init__(message)


def raise_if_any(problems: Sequence[str]) -> None:
  if problems:
    raise LaunchError(problems)


def nearest(name: str, known: Iterable[str]) -> Optional[str]:
  """The known name closest to `name` (case-insensitive), or None when none is close."""
  known = sorted(set(known))
  lowered = {k.lower(): k for k in known}
  match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
  return lowered[match[0]] if match else None


def _did_you_mean(name: str, known: Iterable[str]) -> str:
  match = nearest(name, known)
  return f"; did you mean {match}?" if match else ""


# ---------------------------------------------------------------------------
# Bindings, one at a time (before parsing).


def split_binding(binding: str) -> Optional[Tuple[str, str]]:
  """'NAME = VALUE' -> (NAME, VALUE); None for what is not one simple binding (several
  lines, an include, an import), which gin's own parser judges."""
  text = binding.strip()
  if "\n" in text or text.startswith(("include", "import")):
    return None
  name, sep, value = text.partition("=")
  if not sep:
    return None
  return name.strip(), value.strip()


def value_problem(name: str, value: str) -> Optional[str]:
  """Why gin cannot read `value` (None when it can): gin values are Python literals,
  @references and %macros. A bare word or path is the usual mistake: the shell ate the
  quotes."""
  if "@" in value or "%" in value:
    return None  # References: gin's parser judges them.
  try:
    ast.literal_eval(value)
    return None
  except (ValueError, SyntaxError):
    pass
  if not value:
    return f"--gin.{name}= has no value: pass --gin.{name}=VALUE"
  return (f"--gin.{name}={value}: {value!r} is not a value gin reads (numbers, True, False, "
          f"None, tuples, and strings in quotes); a string needs quotes inside the shell's: "
          f"--gin.{name}=\"'{value}'\"")


def _configurable_names() -> Dict[str, object]:
  """{short name: Configurable} of every registered configurable (module-qualified
  names too)."""
  names = {}
  for selector, configurable in gin_config._REGISTRY.items():  # pylint: disable=protected-access
    names[selector] = configurable
    names[selector.rsplit(".", 1)[-1]] = configurable
  return names


def parameters_of(configurable) -> List[str]:
  """The parameter names a configurable takes."""
  try:
    signature = inspect.signature(configurable.wrapped)
  except (TypeError, ValueError):
    return []
  return [n for n, p in signature.parameters.items()
          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n != "self"]


def name_problem(name: str) -> Optional[str]:
  """Why the left side of a binding names nothing (None when it names a parameter of a
  registered configurable, or is a macro, which `config_problems` judges once parsed)."""
  if "." not in name or name.startswith("%"):
    return None  # A macro.
  selector, _, parameter = name.rpartition(".")
  configurable_name = selector.rsplit("/", 1)[-1]
  registered = _configurable_names()
  configurable = registered.get(configurable_name)
  if configurable is None:
    # A module-qualified parameter path ('specdec_jax.sharding.f.x'): gin resolves it.
    if any(s.endswith("." + configurable_name) for s in registered):
      return None
    return (f"--gin.{name}: no configurable named {configurable_name!r}"
            + _did_you_mean(configurable_name, [n for n in registered if "." not in n]))
  known = parameters_of(configurable)
  if known and parameter not in known:
    return (f"--gin.{name}: {configurable_name} has no setting {parameter!r}"
            + _did_you_mean(parameter, known) + f" ({configurable_name}'s settings: "
            + ", ".join(known) + ")")
  return None


def binding_problems(bindings: Sequence[str]) -> Tuple[List[str], List[str]]:
  """(problems, the bindings without one): each binding's value and name checked
  alone, so that the good ones can still be parsed and checked further."""
  problems, good = [], []
  for binding in bindings:
    parts = split_binding(binding)
    if parts is None:
      good.append(binding)
      continue
    name, value = parts
    problem = value_problem(name, value) or name_problem(name)
    if problem:
      problems.append(problem)
    else:
      good.append(binding)
  return problems, good


# ---------------------------------------------------------------------------
# The parsed configuration as a whole.


def _references(value):
  """Every gin reference inside a bound value (lists, tuples and dicts searched)."""
  if isinstance(value, gin_config.ConfigurableReference):
    yield value
  elif isinstance(value, (list, tuple, set)):
    for v in value:
      yield from _references(v)
  elif isinstance(value, dict):
    for v in value.values():
      yield from _references(v)


def _is_required(value) -> bool:
  return value is gin.REQUIRED or (
      isinstance(value, gin_config.ConfigurableReference)
      and value.selector == "gin.constant" and value.scoped_selector.startswith("gin.REQUIRED"))


def _macro_name(reference) -> Optional[str]:
  return reference.scoped_selector.rsplit("/", 1)[0] if reference.selector == "gin.macro" \
      else None


def _bindings_of(scope: str, selector: str) -> Dict[str, object]:
  """The parameters bound for `selector` in `scope`: the unscoped bindings, then each
  enclosing scope's (gin's precedence: the innermost wins)."""
  config = gin_config._CONFIG  # pylint: disable=protected-access
  out = dict(config.get(("", selector), {}))
  parts = scope.split("/") if scope else []
  for i in range(1, len(parts) + 1):
    out.update(config.get(("/".join(parts[:i]), selector), {}))
  return out


def _required_defaults(selector: str) -> List[str]:
  """The parameters whose Python default is gin.REQUIRED."""
  configurable = gin_config._REGISTRY.get(selector)  # pylint: disable=protected-access
  if configurable is None:
    return []
  try:
    signature = inspect.signature(configurable.wrapped)
  except (TypeError, ValueError):
    return []
  return [n for n, p in signature.parameters.items() if p.default is gin.REQUIRED]


def selector_of(configurable_class) -> str:
  """The gin selector a registered class goes by (module-qualified, whatever the module
  is called: `__main__` when its file runs as a script)."""
  for selector, configurable in gin_config._REGISTRY.items():  # pylint: disable=protected-access
    if configurable.wrapped is configurable_class or configurable.wrapper is configurable_class:
      return selector
  raise ValueError(f"{configurable_class!r} is not a gin configurable")


def reachable(root: str) -> Tuple[Set[Tuple[str, str]], Set[str]]:
  """({(scope, selector)} of every configurable the root builds, {macro names} it reads),
  following references from `root` (a selector, `selector_of`) through the parsed
  bindings."""
  seen, macros, stack = set(), set(), [("", root)]
  while stack:
    node = stack.pop()
    if node in seen:
      continue
    seen.add(node)
    scope, selector = node
    for value in _bindings_of(scope, selector).values():
      for ref in _references(value):
        macro = _macro_name(ref)
        if macro is not None:
          if macro not in macros:
            macros.add(macro)
            stack.append((macro, "gin.macro"))
          continue
        if ref.selector == "gin.constant":
          continue
        ref_scope = ref.scoped_selector.rsplit("/", 1)[0] if "/" in ref.scoped_selector else ""
        stack.append((ref_scope, ref.configurable.selector))
  return seen, macros


def defined_macros() -> Set[str]:
  """The macros the parsed configuration defines."""
  return {scope for scope, selector in gin_config._CONFIG  # pylint: disable=protected-access
          if selector == "gin.macro"}


def _macro_files(search_dir: str) -> Dict[str, List[str]]:
  """{macro: [gin files under search_dir that define it]}."""
  out: Dict[str, List[str]] = {}
  for path in sorted(glob.glob(os.path.join(search_dir, "**", "*.gin"), recursive=True)):
    with open(path, encoding="utf-8") as f:
      for name in set(_MACRO_DEFINITION.findall(f.read())):
        if "." not in name:
          out.setdefault(name, []).append(os.path.relpath(path, os.path.dirname(search_dir)))
  return out


# How a required macro's problem says what to pass (a generic line otherwise).
REQUIRED_HINTS = {
    "TARGET_CHECKPOINT": "the target's checkpoint directory: "
                         "--gin.TARGET_CHECKPOINT=\"'/ckpt/target'\"",
    "DRAFT_CHECKPOINT": "the draft's checkpoint directory: --gin.DRAFT_CHECKPOINT=\"'/ckpt/draft'\""
                        " (or a draft kind without a model: "
                        "--gin_file=configs/drafts/prompt_lookup.gin)",
    "PARALLEL_DRAFTER": "a trained PARD drafter: --gin.PARALLEL_DRAFTER=\"'/ckpt/PARD-dir'\" "
                        "(a public PARD directory, or a demo pair directory that ships "
                        "parallel.npz)",
    "INPUT_FILE": "a JSONL or TSV file of inputs: --gin.INPUT_FILE=\"'inputs.jsonl'\" "
                  "(or drop the task gin file and pass --prompt=TEXT)",
}


def config_problems(root: str, user_bindings: Sequence[str], file_macros: Set[str],
                    configs_dir: str, provided: Sequence[str] = ()
                    ) -> Tuple[List[str], List[str]]:
  """(problems, warnings) of the parsed configuration built from `root`.

  Problems: a macro it reads still %gin.REQUIRED; a parameter bound to
  gin.REQUIRED, or required by its Python default and unbound (`provided`:
  the root's parameters the caller fills itself, e.g. `task` under
  --prompt); a user binding of a macro no loaded file defines (with the
  configs/ files that do, or the nearest known name); a user binding of a
  configurable the root never builds. Warnings: a user binding of a macro
  the loaded files define (`file_macros`, `defined_macros()` after parsing
  the files alone) but this configuration never reads.
  """
  nodes, macros = reachable(root)
  config = gin_config._CONFIG  # pylint: disable=protected-access
  problems, warnings = [], []
  for macro in sorted(macros):
    if _is_required(config.get((macro, "gin.macro"), {}).get("value")):
      hint = REQUIRED_HINTS.get(macro, f"--gin.{macro}=VALUE (a string in quotes: "
                                       f"--gin.{macro}=\"'...'\")")
      problems.append(f"{macro} is required: {hint}")
  for scope, selector in sorted(nodes):
    if selector == "gin.macro":
      continue
    bound = _bindings_of(scope, selector)
    short = selector.rsplit(".", 1)[-1]
    where = f"{scope}/{short}" if scope else short
    for parameter, value in sorted(bound.items()):
      if _is_required(value):
        problems.append(f"{where}.{parameter} is required: --gin.{where}.{parameter}=VALUE")
    for parameter in _required_defaults(selector):
      if parameter not in bound and not (selector == root and parameter in provided):
        problems.append(f"{where}.{parameter} is not set: --gin.{where}.{parameter}=VALUE")
  defined_by = _macro_files(configs_dir)
  built = {selector for _, selector in nodes}
  for binding in user_bindings:
    parts = split_binding(binding)
    if parts is None:
      continue
    name = parts[0]
    if "." not in name:  # A macro.
      if name in macros:
        continue
      if name in file_macros:
        warnings.append(f"--gin.{name} is set but nothing in this configuration reads it")
      elif name in defined_by:
        files = defined_by[name]
        problems.append(f"--gin.{name}: {name} is read by {' or '.join(files)}, which this "
                        f"run does not load: add --gin_file={files[0]}")
      else:
        problems.append(f"--gin.{name}: no setting named {name}"
                        + _did_you_mean(name, (macros | file_macros | set(defined_by))))
      continue
    configurable_name = name.rpartition(".")[0].rsplit("/", 1)[-1]
    matches = gin_config._REGISTRY.matching_selectors(configurable_name)  # pylint: disable=protected-access
    if matches and not any(m in built for m in matches):
      problems.append(f"--gin.{name}: this configuration builds no {configurable_name}, so the "
                      "setting would be ignored (is the gin file that uses it missing?)")
  return problems, warnings


# ---------------------------------------------------------------------------
# The output directory.


def output_dir_problem(output_dir: str) -> Optional[str]:
  """Why results could not be written to `output_dir` (None when a test file could be
  created there and removed): checked first, so that a typo costs nothing."""
  if not output_dir:
    return "--output_dir is required: --output_dir=/tmp/run"
  path = os.path.abspath(os.path.expanduser(output_dir))
  probe_dir = path
  while not os.path.exists(probe_dir):  # The nearest existing ancestor must be writable.
    parent = os.path.dirname(probe_dir)
    if parent == probe_dir:
      break
    probe_dir = parent
  if not os.path.isdir(probe_dir):
    return (f"--output_dir={output_dir}: {probe_dir} is a file, not a directory; choose "
            "another --output_dir")
  # A real write, not os.access: as root, os.access says yes to read-only mounts'
  # directories and /proc, and the run would fail only after loading and compiling.
  probe = os.path.join(probe_dir, f".write_probe_{uuid.uuid4().hex}")
  try:
    if probe_dir == path:
      with open(probe, "wb") as f:
        f.write(b"probe")
      os.remove(probe)
    else:  # The directory is made later: a directory must be creatable there.
      os.mkdir(probe)
      os.rmdir(probe)
  except OSError as e:
    where = ("cannot write there" if probe_dir == path
             else f"cannot create it: {probe_dir} refuses new directories")
    return f"--output_dir={output_dir}: {where} ({e.strerror}); choose another --output_dir"
  return None
