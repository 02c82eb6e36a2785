"""How a family's 2-D projection kernels are stored: [in, out] or [out, in].

Flax, T5X and every checkpoint reader here use [in, out] ('in_out'). XLA's CPU
backend reads [out, in] ('out_in', Hugging Face's Linear layout: contract both
operands' last axes) markedly faster: on the 2-core CPU of BENCHMARKS.md
("Issue 30") a GPT-2-medium-shaped step drops from 88 to 60 ms and a 5-token
verification block from 178 to 106 ms. The function is the same; only the
storage and the dot's contraction change. Each family's config carries
`kernel_layout`, its `Dense` contracts through `project`, and
`with_kernel_layout` converts a model (its checkpoints stay in_out).
"""

import jax

Array = jax.Array
KERNEL_LAYOUTS = ("in_out", "out_in")


def check_layout(layout: str) -> None:
  if layout not in KERNEL_LAYOUTS:
    raise ValueError(f"kernel_layout must be one of {KERNEL_LAYOUTS}, got {layout!r}")


def kernel_shape(layout: str, in_features: int, out_features: int):
  """The stored shape of a kernel projecting in_features -> out_features."""
  return (out_features, in_features) if layout == "out_in" else (in_features, out_features)


def project(x: Array, kernel: Array, layout: str, preferred_element_type=None) -> Array:
  """x [..., in] through a kernel stored as `layout` -> [..., out]."""
  contract = 1 if layout == "out_in" else 0
  return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (contract,)), ((), ())),
                             preferred_element_type=preferred_element_type)


def transpose_kernels(params):
  """Every projection `kernel` (2-D) of a tree transposed: in_out <-> out_in. (The families'
  trees, their feature heads' and EAGLE-3 heads' name only their projections `kernel`.)"""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x.T if getattr(path[-1], "key", None) == "kernel" and x.ndim == 2 else x,
      params)


def with_kernel_layout(model, layout: str):
  """`model` (any family's `FamilyModel`, its config with a `kernel_layout`) with its kernels
  stored as `layout`: the same function."""
  check_layout(layout)
  if layout == model.config.kernel_layout:
    return model
  return type(model)(model.config.replace(kernel_layout=layout), transpose_kernels(model.params))
