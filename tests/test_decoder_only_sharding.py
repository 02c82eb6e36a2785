"""Sharding decoder-only models: logical axes, the planner, sharded decoding on 8 CPU devices.

As in tests/test_sharding.py, the tests named `multidevice` run in a
subprocess with 8 CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`).
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specdec_jax.families.decoder_only import sharding as dos
from specdec_jax import sharding
from specdec_jax.decoder_only_generation import decoder_only_generate
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.loading import load_decoder_only_model
from specdec_jax.families.decoder_only.config import DECODER_CONFIGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI = jax.device_count() >= 8
multidevice = pytest.mark.skipif(not MULTI, reason="needs 8 devices (run in the subprocess)")


@pytest.mark.parametrize("name", sorted(DECODER_CONFIGS))
def test_logical_axes_cover_every_named_config(name):
  params = dos.abstract_params(DECODER_CONFIGS[name])
  axes = dos.params_logical_axes(params)
  flat = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0])
  assert len(flat) == len(jax.tree_util.tree_leaves(params))


def test_logical_axes_of_each_kind_and_errors():
  assert dos.param_logical_axes(("layers_0", "self_attn", "k_proj", "kernel"), 2) == (
      "embed", "joined_kv")
  assert dos.param_logical_axes(("layers_0", "self_attn", "q_proj", "bias"), 1) == ("joined_kv",)
  assert dos.param_logical_axes(("layers_0", "mlp", "down_proj", "bias"), 1) == ("embed",)
  assert dos.param_logical_axes(("embed_positions", "embedding"), 2) == (None, "embed")
  assert dos.param_logical_axes(("norm", "bias"), 1) == ("embed",)
  with pytest.raises(ValueError, match="decoder-only parameter tree"):
    dos.param_logical_axes(("decoder", "relpos_bias", "rel_embedding"), 2)
  with pytest.raises(ValueError, match="rank 3"):
    dos.param_logical_axes(("lm_head", "kernel"), 3)


def test_planner_shards_qwen2_7b_and_flags_few_kv_heads():
  plan = dos.plan_decoder_only_memory(DECODER_CONFIGS["qwen2_7b"], batch=8, max_len=2048,
                                      mesh_shape="1,4", dtype="bfloat16")
  assert plan.params_bytes == 2 * DECODER_CONFIGS["qwen2_7b"].num_params
  # Every big weight is split four ways; only norms and biases are replicated.
  assert plan.params_bytes_per_device < 0.26 * plan.params_bytes
  assert plan.cache_bytes == 2 * 28 * 8 * 2048 * 4 * 128 * 2
  assert plan.cache_bytes_per_device == plan.cache_bytes // 4
  # Qwen2-7B has 4 KV heads: an 8-way model axis cannot split its cache.
  with pytest.raises(ValueError, match="heads"):
    dos.plan_decoder_only_memory(DECODER_CONFIGS["qwen2_7b"], batch=8, max_len=2048,
                                 mesh_shape="1,8")
  with pytest.warns(UserWarning, match="Replicating this dimension"):
    replicated = dos.plan_decoder_only_memory(DECODER_CONFIGS["qwen2_7b"], batch=8,
                                              max_len=2048, mesh_shape="1,8", dtype="bfloat16",
                                              on_indivisible="replicate")
  assert replicated.cache_bytes_per_device == replicated.cache_bytes


# ---------------------------------------------------------------------------
# Eight devices.

def test_multidevice_in_subprocess():
  if MULTI:
    pytest.skip("already running with 8 devices")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=0 "
                       "--xla_llvm_disable_expensive_passes=true")
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "multidevice",
       os.path.abspath(__file__)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  summary = result.stdout.strip().splitlines()[-1]
  assert "1 skipped" in summary and "failed" not in summary, result.stdout[-2000:]


@multidevice
def test_multidevice_sharded_decoding_equals_unsharded():
  # Every sharded dimension divides the 2-way model axis (vocab 96, 2 KV heads).
  base = load_decoder_only_model("llama_tiny", vocab_size=96, seed=1, dtype="float32")
  target = DecoderOnlyModel(base.config, jax.tree_util.tree_map(
      lambda x: x * 5.0 if x.ndim == 2 else x, base.params))
  leaves, treedef = jax.tree_util.tree_flatten(target.params)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  draft = DecoderOnlyModel(target.config, jax.tree_util.tree_unflatten(
      treedef, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
  lengths = np.array([5, 2, 7, 3, 6, 1, 4, 7])
  prompts = np.random.RandomState(0).randint(3, 96, (8, 7)).astype(np.int32)
  want = decoder_only_generate(target, prompts, lengths, max_decode_steps=8, draft=draft,
                               gamma=3, eos_id=-1)

  target_part, draft_part = sharding.make_partitioners("4,2")
  sharded = dos.shard_decoder_only_model(target, target_part)
  q = sharded.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
  assert q.sharding.spec == P(None, "model")
  assert sharded.params["embed_tokens"]["embedding"].sharding.spec == P("model")
  plan = dos.plan_decoder_only_memory(target.config, batch=8, max_len=14, mesh_shape="4,2")
  assert sharding.device_bytes(sharded.params) == plan.params_bytes_per_device
  cache = target.init_cache(8, 14)
  placed = jax.device_put(cache, dos.cache_shardings(target_part, cache))
  assert sharding.device_bytes(placed) == plan.cache_bytes_per_device

  got = decoder_only_generate(sharded, prompts, lengths, max_decode_steps=8, gamma=3, eos_id=-1,
                              draft=dos.shard_decoder_only_model(draft, draft_part))
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  np.testing.assert_array_equal(got.stats.accepted, want.stats.accepted)
  # The same under the partitioners: cache pinned, activations constrained.
  got = decoder_only_generate(target, prompts, lengths, max_decode_steps=8, gamma=3, eos_id=-1,
                              draft=draft, partitioner=target_part, draft_partitioner=draft_part)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  got = decoder_only_generate(sharded, prompts, lengths, max_decode_steps=8, eos_id=-1,
                              partitioner=target_part)
  target_only = decoder_only_generate(target, prompts, lengths, max_decode_steps=8, eos_id=-1)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(target_only.sequences))
  np.testing.assert_array_equal(np.asarray(target_only.sequences), np.asarray(want.sequences))


@multidevice
def test_multidevice_hf_directory_loads_straight_into_shards(tmp_path):
  from specdec_jax.families.decoder_only.checkpoints import export_hf_decoder_only
  model = load_decoder_only_model("qwen2_tiny", vocab_size=96, seed=4, dtype="float32")
  export_hf_decoder_only(model, tmp_path)
  target_part, _ = sharding.make_partitioners("2,4")
  loaded = dos.load_sharded_decoder_only(tmp_path, target_part, dtype="float32")
  expected = dos.param_shardings(target_part, model.params)
  for got, want, sharding_ in zip(jax.tree_util.tree_leaves(loaded.params),
                                  jax.tree_util.tree_leaves(model.params),
                                  jax.tree_util.tree_leaves(expected)):
    assert got.sharding == sharding_
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
