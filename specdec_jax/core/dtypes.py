"""One spelling for compute dtypes: `canonical_dtype` and matmul precision.

Every function that takes a dtype accepts what JAX users write (`jnp.bfloat16`,
`np.float32`, `np.dtype('float16')`, `"bfloat16"`, `"bf16"`, `"fp32"`, ...)
and stores the canonical name ('float32', 'bfloat16' or 'float16'), so configs
stay hashable and compare equal however the dtype was spelled.
"""

import contextlib
from typing import Any, Optional

import jax
import numpy as np

SUPPORTED = ("float32", "bfloat16", "float16")

_ALIASES = {
    "float32": "float32", "f32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
}

# JAX's names for matmul precision; 'highest' makes float32 matmuls really
# float32 on GPUs (which otherwise use TF32) and TPUs (bf16 passes).
MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


def canonical_dtype(dtype: Any, what: str = "dtype") -> str:
  """'float32' | 'bfloat16' | 'float16' for any common spelling of those dtypes.

  Raises:
    ValueError: naming the value and the accepted spellings.
  """
  if isinstance(dtype, str):
    name = _ALIASES.get(dtype.strip().lower())
  else:
    try:  # jnp.bfloat16, np.float32, np.dtype(...), ml_dtypes scalar types.
      name = _ALIASES.get(np.dtype(dtype).name)
    except TypeError:
      name = None
  if name is None:
    raise ValueError(f"{what} {dtype!r} is not supported: use one of {', '.join(SUPPORTED)} "
                     f"(as a string such as 'bf16', or jnp.bfloat16 / np.float32)")
  return name


def optional_dtype(dtype: Any, what: str = "dtype") -> Optional[str]:
  """`canonical_dtype`, letting None (and '') mean 'the default'."""
  if dtype is None or (isinstance(dtype, str) and not dtype.strip()):
    return None
  return canonical_dtype(dtype, what)


def check_matmul_precision(precision: Optional[str]) -> Optional[str]:
  """Validates a `jax.default_matmul_precision` name (None = JAX's default)."""
  if precision is None:
    return None
  if not isinstance(precision, str) or precision.lower() not in MATMUL_PRECISIONS:
    raise ValueError(f"matmul_precision {precision!r}: use one of {', '.join(MATMUL_PRECISIONS)} "
                     "('highest' = full float32 on GPUs/TPUs)")
  return precision.lower()


def matmul_precision_scope(precision: Optional[str]):
  """`jax.default_matmul_precision(precision)`, or nothing for None.

  Wraps a compiled program's *call*: the precision is read when the program is
  traced, on its first call.
  """
  if precision is None:
    return contextlib.nullcontext()
  import jax  # Keeps this module importable without initialising jax.
  return jax.default_matmul_precision(precision)


def default_dtype() -> str:
  """float32 on CPU (bf16 is ~4x slower there), bfloat16 on TPU/GPU."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"
