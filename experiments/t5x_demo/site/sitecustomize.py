"""Lets `python -m t5x.infer` (and eval/train) import on current jax.

Put this folder on PYTHONPATH. T5X imports `jestimator` 0.3.3 (PyPI, 2022),
whose `amos_helper` does `from jax.experimental.pjit import PartitionSpec`, a
name current jax no longer has; aliasing it before anything imports T5X is the
whole fix (see specdec_jax.t5x.model.alias_jestimator_partition_spec).
"""
try:
  import jax
  import jax.experimental.pjit as _pjit
  if not hasattr(_pjit, "PartitionSpec"):
    _pjit.PartitionSpec = jax.sharding.PartitionSpec
except ImportError:  # No jax in this interpreter: nothing to alias.
  pass
