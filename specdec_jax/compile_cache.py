"""JAX's persistent compilation cache, on by default for every entry point.

The first call of a decode compiles it (seconds for a tiny model, tens of
seconds for a 1B one); a later process with the same shapes reads the
compiled program back from disk instead. The launcher, the demo and the
tests call `enable_compile_cache()` once at start.

SPECDEC_JAX_CACHE names the directory (default ~/.cache/specdec_jax/jax,
under $XDG_CACHE_HOME when set); SPECDEC_JAX_CACHE= (empty), 0 or off turns
it off. Programs that took under half a second to compile are not stored;
the cache is bounded (LRU, 4 GB) and file-locked between processes.
"""

import os
from typing import Optional

from absl import logging

ENV = "SPECDEC_JAX_CACHE"
OFF = ("", "0", "off", "false", "no")
MAX_BYTES = 4_000_000_000
MIN_COMPILE_SECONDS = 0.5


def default_cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "specdec_jax", "jax")


def cache_dir() -> Optional[str]:
  """The directory SPECDEC_JAX_CACHE names (default `default_cache_dir()`), or None when
  it turns the cache off."""
  value = os.environ.get(ENV)
  if value is None:
    return default_cache_dir()
  return None if value.strip().lower() in OFF else os.path.expanduser(value)


def enable_compile_cache(path: Optional[str] = None) -> Optional[str]:
  """Turns JAX's persistent compilation cache on at `path` (default `cache_dir()`);
  returns the directory, or None when SPECDEC_JAX_CACHE turned it off or the directory
  cannot be created (a warning: decoding works, it just compiles every time).

  A JAX_COMPILATION_CACHE_DIR the user set wins. Call before the first compile.
  """
  import jax
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  path = cache_dir() if path is None else path
  if path is None:
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    logging.warning("compile cache off: cannot create %s (%s); set %s=DIR or %s= to silence",
                    path, e, ENV, ENV)
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  try:
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  except AttributeError:  # Older JAX: unbounded.
    pass
  return path
