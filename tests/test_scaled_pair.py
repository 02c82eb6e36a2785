"""The demo pairs at a large model's cost (`sj.scale_pair`, `make demo`'s act 2): the same
function in float32 and bfloat16, the on-disk cache (rebuilt when its inputs change or its
file is corrupted), the memory budget checked before any work, the kernel layouts, and an
"identical outputs" that is computed (a lossy rule reads "no")."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.core import verification
from specdec_jax.families.kernel_layout import with_kernel_layout
from specdec_jax.tools import speedup

# Small large shapes (fast to build and compile) that still grow every axis: width r = 2,
# heads, MLP units and layers.
SHAPES = {"decoder_only": "gpt2_medium:num_layers=6,emb_dim=384,num_heads=6,mlp_dim=1536",
          "t5": "t5_1_1_base:num_encoder_layers=3,num_decoder_layers=6,emb_dim=512,num_heads=8,"
                "mlp_dim=1536"}


def _greedy(model, pair, n, steps, **kwargs):
  inputs, lengths = pair.inputs(n)
  return np.asarray(sj.generate(model, inputs, lengths, max_decode_steps=steps,
                                **kwargs).sequences)


@pytest.mark.slow  # ~65 s each (make test budget); act 2's shapes are in make test-slow too
@pytest.mark.parametrize("family", ["decoder_only", "t5"])
def test_embedded_target_and_drafts_keep_the_pairs_function(family, tmp_path):
  """Float32, a small grown shape: greedy outputs of the embedded target equal the shipped
  target's, and every shipped draft drafts the same tokens, accepted at the same places."""
  pair = sj.load_demo_pair(family)
  scaled = sj.scale_pair(pair, SHAPES[family], cache_dir=str(tmp_path), log=None)
  assert scaled.target.config.kernel_layout == "out_in"
  assert scaled.target.config.num_params > 3 * pair.target.config.num_params
  steps = 24
  np.testing.assert_array_equal(_greedy(scaled.target, pair, 4, steps),
                                _greedy(pair.target, pair, 4, steps))
  inputs, lengths = pair.inputs(2)
  for name, draft in pair.drafts.items():
    gamma = min(4, sj.as_draft(draft).max_gamma or 4)
    small = sj.generate(pair.target, inputs, lengths, max_decode_steps=steps, draft=draft,
                        gamma=gamma)
    large = sj.generate(scaled.target, inputs, lengths, max_decode_steps=steps,
                        draft=scaled.drafts[name], gamma=gamma)
    np.testing.assert_array_equal(np.asarray(large.sequences), np.asarray(small.sequences))
    np.testing.assert_array_equal(np.asarray(large.stats.accepted),
                                  np.asarray(small.stats.accepted), err_msg=name)


@pytest.mark.slow  # builds act 2's default shapes (0.2B and 0.39B parameters)
@pytest.mark.parametrize("family", ["decoder_only", "t5"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_act2_target_decodes_what_the_shipped_target_decodes(family, dtype, tmp_path):
  """Act 2's embedded targets (the demo's default shapes) compute the shipped target's
  function on held-out inputs. First-copy growth keeps every product; sums run in another
  order, so this is not a bitwise promise. Float32: the greedy outputs are equal. Bfloat16:
  the teacher-forced logits agree within a few bfloat16 steps, and a row may leave the
  shipped target's greedy path only at a near-tie, one whose two logits differ by no more
  than the logits themselves do (3 of 8 T5 rows do since aed2353's pairwise sums: two at
  exact ties of the shipped target, one at a gap of half a bfloat16 step; the drift is one
  step, 0.0625. Before it, 2 rows: which near-ties flip depends on the sums' order)."""
  from experiments.demo_act2 import DEFAULT_SHAPES
  from specdec_jax.families.registry import family_of
  pair = sj.load_demo_pair(family, dtype=dtype)
  scaled = sj.scale_pair(pair, DEFAULT_SHAPES[family], cache_dir=str(tmp_path), log=None)
  steps = 24 if family == "decoder_only" else 40
  grown, shipped = _greedy(scaled.target, pair, 8, steps), _greedy(pair.target, pair, 8, steps)
  if dtype == "float32":
    np.testing.assert_array_equal(grown, shipped)
    return
  # Teacher-forced on the shipped target's own outputs: the laws each model saw at each step.
  kind = family_of(pair.target)
  inputs, lengths = pair.inputs(8)
  tokens, checked_lengths = kind.check_inputs(pair.target.config, inputs, lengths, steps)
  out = sj.generate(pair.target, inputs, lengths, max_decode_steps=steps)
  batch = kind.continuation_batch(pair.target.config, tokens, checked_lengths,
                                  np.asarray(out.sequences), np.asarray(out.lengths))
  logits = {}
  for name, model in (("shipped", pair.target), ("grown", scaled.target)):
    logits[name], targets, weights = map(np.asarray, kind.token_logits(model.config,
                                                                       model.params, batch))
  scored = weights > 0
  for row in range(len(shipped)):  # position j of the scored ones predicts new token j
    np.testing.assert_array_equal(targets[row][scored[row]],
                                  shipped[row][:int(out.lengths[row])])
  drift = np.abs(logits["grown"] - logits["shipped"])[scored].max()
  scale = np.abs(logits["shipped"][scored]).max()
  assert drift <= 2 ** -5 * scale, (drift, scale)  # a few bfloat16 steps (2^-8 relative)
  differing = [row for row in range(len(grown)) if not np.array_equal(grown[row], shipped[row])]
  assert len(differing) <= 3, differing  # each one a near-tie, checked below
  for row in differing:
    step = int(np.argmax(grown[row] != shipped[row]))
    position = np.flatnonzero(scored[row])[step]
    law = logits["shipped"][row, position]
    gap = law[shipped[row, step]] - law[grown[row, step]]
    # Teacher-forced and incremental logits round apart too, so the sign may not hold.
    assert abs(gap) <= 2 * drift, (row, step, gap, drift)


@pytest.mark.parametrize("family", ["decoder_only", "t5"])
def test_kernel_layouts_compute_the_same_function(family):
  pair = sj.load_demo_pair(family)
  model = with_kernel_layout(pair.target, "out_in")
  assert model.config.kernel_layout == "out_in"
  kernels = [x for p, x in jax.tree_util.tree_flatten_with_path(pair.target.params)[0]
             if p[-1].key == "kernel"]
  assert kernels and all(x.ndim == 2 for x in kernels)
  steps = 16
  np.testing.assert_array_equal(_greedy(model, pair, 3, steps), _greedy(pair.target, pair, 3,
                                                                         steps))
  back = with_kernel_layout(model, "in_out")
  jax.tree_util.tree_map(np.testing.assert_array_equal, back.params, pair.target.params)
  with pytest.raises(ValueError, match="kernel_layout"):
    with_kernel_layout(pair.target, "columns")


def test_cache_is_reused_rebuilt_when_inputs_change_and_when_corrupted(tmp_path):
  pair = sj.load_demo_pair("decoder_only")
  shape = SHAPES["decoder_only"]
  first = sj.scale_pair(pair, shape, cache_dir=str(tmp_path), log=None)
  assert not first.from_cache and os.path.exists(first.cache_path)
  again = sj.scale_pair(pair, shape, cache_dir=str(tmp_path), log=None)
  assert again.from_cache and again.cache_path == first.cache_path
  jax.tree_util.tree_map(np.testing.assert_array_equal, again.target.params, first.target.params)

  # An input changes (the feature head's weights): a new entry; the stale one is removed.
  head = pair.drafts["feature"]
  pair.drafts["feature"] = sj.FeatureDraft(pair.target, head_params=jax.tree_util.tree_map(
      lambda x: x * 1.01, head.head_params))
  changed = sj.scale_pair(pair, shape, cache_dir=str(tmp_path), log=None)
  assert not changed.from_cache and changed.cache_path != first.cache_path
  assert not os.path.exists(first.cache_path)
  pair.drafts["feature"] = head

  # The dtype is an input too.
  other = sj.scale_pair(pair, shape, dtype="bfloat16", cache_dir=str(tmp_path), log=None)
  assert not other.from_cache and other.target.config.dtype == "bfloat16"
  # ... and read back as bfloat16, bit for bit (numpy alone loads it as '|V2').
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    back = sj.scale_pair(pair, shape, dtype="bfloat16", cache_dir=str(tmp_path), log=None)
  assert back.from_cache
  jax.tree_util.tree_map(np.testing.assert_array_equal, back.target.params, other.target.params)

  # A corrupted file: a warning naming it, then rebuilt (and the same function).
  rebuilt = sj.scale_pair(pair, shape, cache_dir=str(tmp_path), log=None)
  path = rebuilt.cache_path
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 0xFF]))
  with pytest.warns(UserWarning, match="unusable.*rebuilding"):
    fixed = sj.scale_pair(pair, shape, cache_dir=str(tmp_path), log=None)
  assert not fixed.from_cache
  np.testing.assert_array_equal(_greedy(fixed.target, pair, 2, 16),
                                _greedy(pair.target, pair, 2, 16))
  assert sj.scale_pair(pair, shape, cache_dir=str(tmp_path), log=None).from_cache


def test_memory_budget_is_checked_before_anything_is_allocated(tmp_path):
  pair = sj.load_demo_pair("decoder_only")
  with pytest.raises(sj.MemoryBudgetError, match=r"gpt2_xl needs \d+\.\d\d GB \([\d,]+ bytes of "
                     r"target weights.*budget.*MEMORY_GB"):
    sj.scale_pair(pair, "gpt2_xl", cache_dir=str(tmp_path), memory_budget_bytes=4 << 30)
  assert not os.listdir(tmp_path)  # nothing built, nothing cached
  with pytest.raises(sj.EmbeddingError, match="emb_dim 400 is not a multiple of 192"):
    sj.scale_pair(pair, "gpt2_medium:emb_dim=400", cache_dir=str(tmp_path))
  with pytest.raises(sj.EmbeddingError, match="not field=value"):
    sj.scale_pair(pair, "gpt2_medium:layers", cache_dir=str(tmp_path))


def _accept_everything(rngs, draft_tokens, draft_probs, target_probs, num_drafted=None,
                       greedy=False):
  """A lossy rule a researcher might write: keep every draft, append the target's argmax."""
  batch, gamma = draft_tokens.shape
  count = (jnp.full((batch,), gamma, jnp.int32) if num_drafted is None
           else num_drafted.astype(jnp.int32))
  last = jnp.take_along_axis(target_probs, count[:, None, None], axis=1)[:, 0]
  return count, jnp.argmax(last, axis=-1).astype(jnp.int32)


def test_identical_outputs_is_computed_a_lossy_rule_reads_no(monkeypatch):
  from experiments import demo_act2
  pair = sj.load_demo_pair("decoder_only")
  drafts = {"draft": pair.drafts["draft"]}
  inputs, lengths = pair.inputs(2)
  costs = speedup.Costs(curve={1: 1.0, 5: 1.5}, step_ms=1.0, c={"draft": 0.1}, start_ms=0.0)
  exact = speedup.measure_rows(pair.target, drafts, inputs, lengths, 24, costs, repeats=0,
                               max_gamma=4, alphas={"draft": 0.8})
  assert exact[0].identical is True
  monkeypatch.setitem(verification.VERIFIERS, "accept_everything", _accept_everything)
  lossy = speedup.measure_rows(pair.target, drafts, inputs, lengths, 24, costs, repeats=0,
                               max_gamma=4, alphas={"draft": 0.8},
                               side_kwargs={"draft": dict(verification="accept_everything")})
  assert lossy[0].identical is False
  exact[0].measured = lossy[0].measured = 1.0  # (repeats=0: no timings to compare)
  assert demo_act2.summary({"decoder_only": exact}).endswith("identical outputs: yes")
  assert demo_act2.summary({"decoder_only": exact + lossy}).endswith("identical outputs: no")


def test_demo_rejects_an_unknown_pair_before_any_work():
  import subprocess
  import sys
  result = subprocess.run([sys.executable, "-m", "experiments.demo", "--pair=unknown"],
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode != 0
  assert "--pair" in result.stderr and "both" in result.stderr and "decoder_only" in result.stderr
  assert "Act 1" not in result.stdout
