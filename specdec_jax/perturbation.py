"""Perturbed copies of a model: stand-in drafts that disagree with it a little.

A draft that agrees with the target everywhere (or nowhere) proves nothing
about speculative decoding; a draft whose weights are the target's plus noise
has an acceptance rate strictly inside (0, 1). The launcher's offline demos
(`ModelSpec.perturb_target`), the benchmarks and the tests draft with one.
"""

import jax

from specdec_jax.families.registry import family_of


def perturbed_model(model, noise: float, seed: int = 1):
  """A copy of `model` (any family) with every weight w replaced by w * (1 + noise * N(0, 1))."""
  leaves, treedef = jax.tree_util.tree_flatten(model.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [w * (1 + noise * jax.random.normal(k, w.shape, w.dtype)) for w, k in zip(leaves, keys)]
  return family_of(model).model_type(model.config, jax.tree_util.tree_unflatten(treedef, noisy))
