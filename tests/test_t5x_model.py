"""The T5X-style `predict_batch` path decodes exactly like `specdec_jax.generate`."""

import jax
import numpy as np
import pytest

from specdec_jax import generation
from specdec_jax.core import decoding
from specdec_jax.tools import testing
from specdec_jax.t5x.model import SpeculativeEncoderDecoderModel

MAX_DECODE = 12


@pytest.fixture(scope="module")
def pair():
  # One layer per stack keeps the four compiles of each case quick.
  return testing.tiny_pair(vocab_size=64, noise=0.1, num_encoder_layers=1,
                           num_decoder_layers=1)


def _batch(target):
  enc = testing.random_encoder_tokens(3, 7, target.config.vocab_size, seed=3)
  return {"encoder_input_tokens": enc,
          "decoder_input_tokens": np.zeros((3, MAX_DECODE), np.int32)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [False, True], ids=["temperature_sample",
                                                            "speculative_sample"])
def test_predict_batch_equals_generate(pair, temperature, speculative):
  target, draft = pair
  batch = _batch(target)
  rng = jax.random.PRNGKey(7)
  decode_fn = decoding.speculative_sample if speculative else decoding.temperature_sample
  model = SpeculativeEncoderDecoderModel(target.config, draft=draft.config, decode_fn=decode_fn,
                                         gamma=3, temperature=temperature)
  params = {"target": target.params, "draft": draft.params}
  decodes, aux = model.predict_batch_with_aux(params, batch, rng=rng)
  expected = generation.generate(target, batch["encoder_input_tokens"],
                                 max_decode_steps=MAX_DECODE, temperature=temperature, rng=rng,
                                 draft=draft if speculative else None, gamma=3)
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(expected.sequences))
  np.testing.assert_array_equal(np.asarray(model.predict_batch(params, batch, rng=rng)),
                                np.asarray(decodes))
  if speculative:
    np.testing.assert_array_equal(np.asarray(aux["iterations"]), expected.stats.iterations)
  else:
    assert aux["scores"].shape == (3,)


def test_prompt_lookup_reads_the_encoder_context_as_generate_does(pair):
  """The adapter builds the drafts' `Context` itself (T5X passes no lengths, under its
  pjit): prompt lookup, which reads it, drafts exactly as under `generate`."""
  from specdec_jax.drafts import PromptLookupDraft
  from specdec_jax.families.t5.family import FAMILY
  from specdec_jax.t5x.model import encoder_context
  target, _ = pair
  # Right padding, an inner 0 and an empty row: the lengths `generate` computes.
  tokens = np.array([[5, 0, 7, 0, 0], [3, 4, 5, 6, 7], [0, 0, 0, 0, 0]], np.int32)
  context = jax.jit(lambda t: encoder_context(t, target.config.pad_id))(tokens)
  want = FAMILY.check_inputs(target.config, tokens, None, MAX_DECODE)[1]
  np.testing.assert_array_equal(np.asarray(context.lengths), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(context.lengths), [3, 5, 0])
  assert not context.continued
  batch = _batch(target)
  # Rows repeat a pattern so lookups hit; random lengths make the padding matter.
  batch["encoder_input_tokens"] = np.asarray(batch["encoder_input_tokens"]).copy()
  batch["encoder_input_tokens"][:, :4] = [5, 6, 5, 6]
  draft = PromptLookupDraft(target.config.vocab_size, max_ngram=2)
  model = SpeculativeEncoderDecoderModel(target.config, draft=draft,
                                         decode_fn=decoding.speculative_sample, gamma=3)
  decodes, aux = model.predict_batch_with_aux(target.params, batch)
  expected = generation.generate(target, batch["encoder_input_tokens"],
                                 max_decode_steps=MAX_DECODE, draft=draft, gamma=3)
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(expected.sequences))
  np.testing.assert_array_equal(np.asarray(aux["accepted"]), expected.stats.accepted)


def test_bad_arguments(pair):
  target, draft = pair
  with pytest.raises(ValueError, match="needs a draft"):
    SpeculativeEncoderDecoderModel(target.config, decode_fn=decoding.speculative_sample)
  with pytest.raises(ValueError, match="decode_fn"):
    SpeculativeEncoderDecoderModel(target.config, decode_fn=print)
  with pytest.raises(ValueError, match="vocabulary"):
    SpeculativeEncoderDecoderModel(target.config, draft=draft.config.replace(vocab_size=32))
  spec = SpeculativeEncoderDecoderModel(target.config, draft=draft.config,
                                        decode_fn=decoding.speculative_sample)
  with pytest.raises(ValueError, match="params must be"):
    spec.predict_batch({"target": target.params}, _batch(target))
  with pytest.raises(ValueError, match="num_decodes"):
    spec.predict_batch({"target": target.params, "draft": draft.params}, _batch(target),
                       num_decodes=2)


def test_export_t5x_round_trip(tmp_path, pair):
  """Our T5X writer's layout reads back exactly (T5X's own restore: test_t5x_integration.py)."""
  from flax import serialization, traverse_util
  from specdec_jax import loading
  from specdec_jax.families.t5 import checkpoints
  target, _ = pair
  directory = checkpoints.export_t5x(target, tmp_path / "checkpoint_3", step=3)
  with open(f"{directory}/checkpoint", "rb") as f:
    contents = serialization.msgpack_restore(f.read())
  assert contents["version"] == 3 and int(contents["optimizer"]["state"]["step"]) == 3
  loaded = loading.load_model(directory, dtype="float32")
  assert loaded.config == target.config
  want = traverse_util.flatten_dict(target.params)
  got = traverse_util.flatten_dict(loaded.params)
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key))


def test_t5x_network_packing_equals_separate_rows(pair):
  """T5X's packed batches: two examples in one row score as they do alone (no T5X needed)."""
  import jax.numpy as jnp
  from specdec_jax.t5x.model import T5XNetwork
  target, _ = pair
  network = T5XNetwork(target.config)
  variables = {"params": target.params}
  # Compiled (one program per shape; op-by-op it took ~15 s), as T5X runs it.
  apply = jax.jit(lambda encoder, inputs, targets, packing: network.apply(
      variables, encoder, inputs, targets, enable_dropout=False, **packing))

  def logits(encoder, inputs, targets, decode=False, **packing):
    if decode:  # The error is raised before anything is computed.
      return network.apply(variables, jnp.asarray(encoder), jnp.asarray(inputs),
                           jnp.asarray(targets), enable_dropout=False, decode=True, **packing)
    return np.asarray(apply(jnp.asarray(encoder), jnp.asarray(inputs), jnp.asarray(targets),
                            packing))

  first = dict(encoder=[[5, 6, 7, 1]], inputs=[[0, 3, 4]], targets=[[3, 4, 1]])
  second = dict(encoder=[[9, 8, 1]], inputs=[[0, 2]], targets=[[2, 1]])
  packed = logits([[5, 6, 7, 1, 9, 8, 1, 0]], [[0, 3, 4, 0, 2, 0]], [[3, 4, 1, 2, 1, 0]],
                  encoder_segment_ids=jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]]),
                  decoder_segment_ids=jnp.array([[1, 1, 1, 2, 2, 0]]),
                  encoder_positions=jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]]),
                  decoder_positions=jnp.array([[0, 1, 2, 0, 1, 0]]))
  np.testing.assert_allclose(packed[0, :3], logits(**first)[0], atol=1e-5, rtol=0)
  np.testing.assert_allclose(packed[0, 3:5], logits(**second)[0], atol=1e-5, rtol=0)
  # Unpadded and unpacked, it is the plain teacher-forced model.
  np.testing.assert_allclose(logits(**first)[0], np.asarray(target.logits(
      np.array(first["encoder"], np.int32), np.array(first["inputs"], np.int32)))[0],
      atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="cached decode"):
    logits(**first, decode=True)
