"""`sj.generate_many` in bfloat16 on the shipped demo pairs: each output equals `generate`
on that input alone, bit for bit, target-only and with a model draft (issue 55).

The inputs are ones that differed before `core.rows`: T5 held-out inputs 165 and 239,
decoder-only 63 (greedy, batch_size 4). XLA CPU ran a decode step's norm reductions on
its own loop at batch 1 and on YNNPACK (another summation order) once they held 4096
elements, so a row's 1/rms, rounded into bfloat16 projections, depended on the batch.
The last test checks the mechanism itself: no reduction of either family's decode step
is handed to a library at any batch size tried.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.core import rows
from specdec_jax.demo_pair import load_demo_pair

# Per family: held-out inputs (those that differed first), max_decode_steps, eos_id. The
# decoder-only pair's outputs run to the step limit with its own EOS; 266 ends 5 of its
# 14 within 5 steps, and input 63 (which differed at step 32) never emits it.
CASES = {"t5": (list(range(238, 252)) + [165], 32, None),
         "decoder_only": (list(range(56, 70)), 48, 266)}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
  return load_demo_pair(request.param, dtype="bfloat16", with_feature_head=False)


def _rows(pair, index):
  tokens, lengths = pair.inputs(max(index) + 1)
  return tokens[index], None if lengths is None else lengths[index]


def test_each_output_equals_generate_alone_in_bfloat16(pair):
  index, steps, eos = CASES[pair.family]
  tokens, lengths = _rows(pair, index)
  draft = next(iter(pair.drafts.values()))  # the pair's model draft ('small' / 'draft')
  ended = set()
  for name, extra in (("target-only", {}), ("speculative", dict(draft=draft, gamma=4))):
    kw = dict(max_decode_steps=steps, eos_id=eos, **extra)
    many = sj.generate_many(pair.target, tokens, lengths, batch_size=4, **kw)
    for i in range(len(tokens)):
      one = sj.generate(pair.target, tokens[i:i + 1],
                        None if lengths is None else lengths[i:i + 1], **kw)
      np.testing.assert_array_equal(np.asarray(many.sequences[i]), np.asarray(one.sequences[0]),
                                    err_msg=f"{pair.family} {name}, held-out input {index[i]}")
      ended.add(int(one.lengths[0]))
  assert len(ended) > 1 and min(ended) < steps, ended  # outputs end at different steps


def _library_reductions(hlo: str):
  """Reductions inside the library (YNNPACK / XNNPACK) fusions of an optimised module."""
  calls = set(re.findall(r"kind=kCustom, calls=%([\w.\-]+)[^\n]*(?:ynn|xnn)", hlo))
  bodies = re.split(r"\n(?=%[\w.\-]+ \()", hlo)
  return [b.split(" ", 1)[0] for b in bodies
          if b.split(" ", 1)[0].lstrip("%") in calls and re.search(r"\breduce(-window)?\(", b)]


@pytest.mark.parametrize("batch", [1, 2, 4, 16])
def test_no_reduction_of_a_decode_step_goes_to_a_library(pair, batch):
  """Greedy bits equal across batch sizes only while each row's arithmetic is the same:
  a reduction XLA CPU hands to YNNPACK past 4096 elements would break that."""
  if jax.default_backend() != "cpu":
    pytest.skip("XLA CPU's library fusions")
  model = pair.target
  step = jax.jit(lambda params, t, pos, c: model.block_fn(params)(t, pos, c))
  if pair.family == "t5":
    cache = model.init_cache(batch, 48, jnp.ones((batch, pair.input_len), jnp.int32))
  else:
    cache = model.init_cache(batch, 112)
  hlo = step.lower(model.params, jnp.zeros((batch, 8), jnp.int32), jnp.zeros((batch,), jnp.int32),
                   cache).compile().as_text()
  assert "__ynn_fusion" in hlo or "xnn" in hlo  # the dots still go to the library
  assert _library_reductions(hlo) == []


def test_row_sum_bits_do_not_depend_on_the_rows_beside_them():
  x = jax.random.normal(jax.random.PRNGKey(0), (512, 193), jnp.float32)
  total = jax.jit(rows.row_sum)
  alone = np.stack([np.asarray(total(x[i:i + 1]))[0] for i in range(0, 512, 37)])
  np.testing.assert_array_equal(np.asarray(total(x))[::37], alone)
  np.testing.assert_allclose(np.asarray(total(x))[:, 0], np.asarray(x).sum(-1), rtol=1e-5,
                             atol=1e-4)
  p = jax.jit(rows.softmax)(x)
  np.testing.assert_allclose(np.asarray(p), np.asarray(jax.nn.softmax(x)), rtol=1e-5, atol=1e-7)
