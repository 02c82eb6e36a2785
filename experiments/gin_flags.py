"""The gin command-line flags every experiment entry point shares (T5X style).

`--gin_file` (repeatable), `--gin_bindings` (repeatable) and the shorthand
`--gin.NAME=VALUE` (rewritten by `rewrite_gin_args` before absl parses argv).
Defined once here so that entry points can be imported into one process
(tests, notebooks) without absl's duplicate-flag errors.
"""

import os
from typing import List, Sequence

from absl import app
from absl import flags
import gin

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIN_FILES = flags.DEFINE_multi_string("gin_file", [], "Gin config files, applied in order.")
GIN_BINDINGS = flags.DEFINE_multi_string(
    "gin_bindings", [], "Gin bindings applied after the files (also: --gin.NAME=VALUE).")
GIN_SEARCH_PATHS = flags.DEFINE_multi_string(
    "gin_search_paths", [REPO_ROOT], "Directories to resolve gin `include`s against.")


def rewrite_gin_args(argv: Sequence[str]) -> List[str]:
  """`--gin.NAME=VALUE` -> `--gin_bindings=NAME = VALUE` (as T5X's launcher does)."""
  out = []
  for arg in argv:
    if arg.startswith("--gin."):
      name, sep, value = arg[len("--gin."):].partition("=")
      if not sep:
        raise app.UsageError(f"{arg}: expected --gin.NAME=VALUE")
      arg = f"--gin_bindings={name} = {value}"
    out.append(arg)
  return out


def parse_gin(gin_files: Sequence[str], bindings: Sequence[str],
              search_paths: Sequence[str] = (REPO_ROOT,)) -> None:
  """Clears gin and parses `gin_files` then `bindings`; ValueError on any problem."""
  gin.clear_config()
  for path in search_paths:
    gin.add_config_file_search_path(path)
  for path in gin_files:
    if not (os.path.exists(path) or any(os.path.exists(os.path.join(p, path))
                                        for p in search_paths)):
      raise ValueError(f"gin file not found: {path!r}")
  try:
    gin.parse_config_files_and_bindings(gin_files, bindings, finalize_config=False)
  except (ValueError, KeyError, SyntaxError, OSError) as e:  # OSError: a missing include
    raise ValueError(f"bad gin configuration: {e}") from e


def parse_flags() -> None:
  """Parses the gin flags' current values (call inside an absl `main`)."""
  parse_gin(GIN_FILES.value, GIN_BINDINGS.value, GIN_SEARCH_PATHS.value)
