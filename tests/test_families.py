"""One `load_model` and one `generate` for every model family."""

import jax
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.tools import testing
from specdec_jax.decoder_only_generation import decoder_only_generate


def test_load_model_dispatches_on_names_and_configs():
  assert isinstance(sj.load_model("tiny"), sj.Model)
  assert isinstance(sj.load_model("llama_tiny", dtype="float32"), sj.DecoderOnlyModel)
  assert isinstance(sj.load_model(sj.get_decoder_config("gpt2_tiny")), sj.DecoderOnlyModel)
  with pytest.raises(ValueError, match="decoder-only configs"):
    sj.load_model("no_such_model")


def test_load_model_reads_a_decoder_only_hf_directory(tmp_path):
  model = sj.load_model("qwen2_tiny", dtype="float32", seed=3)
  sj.export_hf_decoder_only(model, str(tmp_path))
  loaded = sj.load_model(str(tmp_path), dtype="float32")
  assert isinstance(loaded, sj.DecoderOnlyModel) and loaded.config == model.config
  for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(loaded.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generate_dispatches_to_decoder_only():
  target = sj.load_model("llama_tiny", dtype="float32", seed=1)
  draft = sj.load_model("llama_tiny_draft", dtype="float32", seed=2)
  prompts = np.array([[5, 6, 7, 8, 0], [9, 10, 0, 0, 0]], np.int32)
  lengths = np.array([4, 2], np.int32)
  for kwargs in (dict(), dict(draft=draft, gamma=3)):
    out = sj.generate(target, prompts, lengths, max_decode_steps=6, **kwargs)
    ref = decoder_only_generate(target, prompts, lengths, max_decode_steps=6, **kwargs)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(ref.sequences))
  plain = sj.generate(target, prompts, lengths, max_decode_steps=6)
  spec = sj.generate(target, prompts, lengths, max_decode_steps=6, draft=draft, gamma=3)
  np.testing.assert_array_equal(np.asarray(spec.sequences), np.asarray(plain.sequences))
  rows = sj.generate(target, prompts, lengths, max_decode_steps=6, batch_invariant=True)
  alone = sj.generate(target, prompts[1:], lengths[1:], max_decode_steps=6)
  np.testing.assert_array_equal(np.asarray(rows.sequences)[1], np.asarray(alone.sequences)[0])


def test_mixing_families_is_a_clear_error():
  t5_target, _ = testing.tiny_pair(vocab_size=32)
  gpt = sj.load_model("gpt2_tiny", dtype="float32", vocab_size=32)
  enc = testing.random_encoder_tokens(1, 4, 32)
  with pytest.raises((TypeError, ValueError), match="(?i)decoder-only|family|T5"):
    sj.generate(t5_target, enc, max_decode_steps=3, draft=gpt)
  with pytest.raises((TypeError, ValueError), match="(?i)decoder-only|family|T5"):
    sj.generate(gpt, enc, max_decode_steps=3, draft=t5_target)
  with pytest.raises(ValueError, match="prompt_lengths"):
    sj.generate(t5_target, enc, np.array([2]), max_decode_steps=3)
