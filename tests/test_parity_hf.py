"""Parity with the reference implementation: transformers' T5ForConditionalGeneration.

Random HF models are built offline from `transformers.T5Config`, written in each
directory format met in practice, loaded by our loader, and compared with the
same directory loaded by transformers: encoder outputs and teacher-forced logits
to 1e-4 (float32), greedy generations token for token (also speculatively).
"""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from specdec_jax.families.t5 import checkpoints
from specdec_jax import generation
from specdec_jax import loading
from specdec_jax.perturbation import perturbed_model
from specdec_jax.tools import testing

VOCAB = 128
ENC_LEN = 20  # Long enough for relative distances beyond the exact buckets.
DECODE_STEPS = 16
TOL = 1e-4


def _random_hf_model(seed, gain=2.0, **config):
  """A T5ForConditionalGeneration whose greedy outputs are not degenerate.

  transformers' init (constant layer norms, small relative bias, narrow
  projections) makes random models repeat one token forever; wider projections
  (`gain`), random norm scales and a strong relative bias make outputs depend
  on the input and the position. Query/key weights stay moderate: sharp
  attention amplifies float32 rounding (HF float32 vs float64 logits differ by
  ~3e-5 here, ~2e-4 with query/key at `gain` 2), and the comparison is at 1e-4.
  """
  torch.manual_seed(seed)
  fields = dict(vocab_size=VOCAB, d_model=48, d_kv=16, d_ff=96, num_layers=2, num_heads=3,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
  fields.update(config)
  hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**fields)).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "layer_norm" in name:
        p.uniform_(0.5, 1.5)
      elif "relative_attention_bias" in name:
        p.normal_(0.0, 3.0)
      elif name in ("shared.weight", "lm_head.weight"):
        p.normal_(0.0, 1.0)
      elif name.endswith((".q.weight", ".k.weight")):
        p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
      else:
        p.normal_(0.0, gain / p.shape[-1] ** 0.5)
  return hf


def _load_reference(directory):
  return transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()


def _write_published_untied(directory, hf, seed):
  """The google/t5-v1_1-* / flan-t5-* layout: separate lm_head.weight, tie false.

  transformers 5.x cannot save this layout itself (it always ties), so the
  directory is written by hand as the published checkpoints are.
  """
  hf.save_pretrained(directory)
  state = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
  state["lm_head.weight"] = torch.randn(state["shared.weight"].shape,
                                        generator=torch.Generator().manual_seed(seed))
  safetensors_torch.save_file(state, os.path.join(directory, "model.safetensors"),
                              metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json")) as f:
    config = json.load(f)
  config["tie_word_embeddings"] = False
  config.pop("scale_decoder_outputs", None)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)


def _inputs(seed=1):
  encoder_tokens = np.asarray(testing.random_encoder_tokens(3, ENC_LEN, VOCAB, seed=seed))
  rng = np.random.RandomState(seed)
  decoder_tokens = np.concatenate([np.zeros((3, 1), np.int64),
                                   rng.randint(2, VOCAB, (3, 11))], axis=1)
  return encoder_tokens, decoder_tokens


def _assert_logits_parity(ours, reference):
  encoder_tokens, decoder_tokens = _inputs()
  mask = encoder_tokens != 0
  with torch.no_grad():
    enc_t, mask_t = torch.tensor(encoder_tokens), torch.tensor(mask)
    ref_encoded = reference.encoder(input_ids=enc_t, attention_mask=mask_t).last_hidden_state
    ref_logits = reference(input_ids=enc_t, attention_mask=mask_t,
                           decoder_input_ids=torch.tensor(decoder_tokens)).logits
  encoded = np.asarray(ours.encode(encoder_tokens))
  # Padding positions are masked out downstream; both sides compute them differently.
  np.testing.assert_allclose(encoded[mask], ref_encoded.numpy()[mask], atol=TOL, rtol=0)
  logits = np.asarray(ours.logits(encoder_tokens, decoder_tokens))
  assert np.abs(ref_logits.numpy()).max() > 1.0  # Not a trivially small comparison.
  np.testing.assert_allclose(logits, ref_logits.numpy(), atol=TOL, rtol=0)


def _assert_greedy_parity(ours, reference):
  encoder_tokens, _ = _inputs(seed=2)
  with torch.no_grad():
    ref = reference.generate(input_ids=torch.tensor(encoder_tokens),
                             attention_mask=torch.tensor(encoder_tokens != 0),
                             max_new_tokens=DECODE_STEPS, do_sample=False, num_beams=1)
  ref = ref.numpy()[:, 1:]  # Drop the decoder start token.
  ref = np.pad(ref, ((0, 0), (0, DECODE_STEPS - ref.shape[1])))  # HF stops when all rows hit EOS.
  assert len(set(ref.ravel().tolist())) >= 8, f"degenerate reference outputs {ref}"
  greedy = generation.generate(ours, encoder_tokens, max_decode_steps=DECODE_STEPS)
  np.testing.assert_array_equal(np.asarray(greedy.sequences), ref)
  draft = perturbed_model(ours, noise=0.1)
  speculative = generation.generate(ours, encoder_tokens, max_decode_steps=DECODE_STEPS,
                                    draft=draft, gamma=3)
  np.testing.assert_array_equal(np.asarray(speculative.sequences), ref)
  assert 0.0 < speculative.stats.acceptance_rate < 1.0


def test_t5_1_1_published_untied_gated_gelu(tmp_path):
  hf = _random_hf_model(0, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
  _write_published_untied(tmp_path, hf, seed=10)
  reference = _load_reference(tmp_path)
  ours = checkpoints.load_checkpoint_model(tmp_path, dtype="float32")
  assert ours.config.mlp_activations == ("gelu", "linear")
  assert not ours.config.logits_via_embedding
  _assert_logits_parity(ours, reference)
  _assert_greedy_parity(ours, reference)

@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow

def test_original_t5_relu_tied_rescaled(tmp_path):
  hf = _random_hf_model(2, gain=3.0, feed_forward_proj="relu", tie_word_embeddings=True)
  hf.save_pretrained(tmp_path)
  reference = _load_reference(tmp_path)
  assert reference.config.scale_decoder_outputs
  ours = loading.load_model(str(tmp_path), dtype="float32")  # Through the public entry.
  assert ours.config.mlp_activations == ("relu",)
  assert ours.config.logits_via_embedding
  _assert_logits_parity(ours, reference)
  _assert_greedy_parity(ours, reference)


def test_transformers5_tied_without_rescaling(tmp_path):
  # transformers 5.x saves an untied config as tie_word_embeddings: true,
  # scale_decoder_outputs: false and no lm_head.weight: logits = shared(h).
  hf = _random_hf_model(2, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
  hf.save_pretrained(tmp_path)
  with open(tmp_path / "config.json") as f:
    saved = json.load(f)
  assert saved["tie_word_embeddings"] and not saved["scale_decoder_outputs"]
  reference = _load_reference(tmp_path)
  ours = checkpoints.load_checkpoint_model(tmp_path, dtype="float32")
  # Materialised as an untied kernel equal to the embedding's transpose.
  assert not ours.config.logits_via_embedding
  np.testing.assert_array_equal(np.asarray(ours.params["decoder"]["logits_dense"]["kernel"]),
                                np.asarray(ours.params["token_embedder"]["embedding"]).T)
  _assert_logits_parity(ours, reference)


def test_uneven_stacks_odd_heads_pytorch_bin(tmp_path):
  hf = _random_hf_model(3, feed_forward_proj="relu", num_layers=3, num_decoder_layers=2,
                        num_heads=3, d_kv=8)
  hf.save_pretrained(tmp_path)
  reference = _load_reference(tmp_path)
  state = safetensors_torch.load_file(tmp_path / "model.safetensors")
  os.remove(tmp_path / "model.safetensors")
  torch.save(state, tmp_path / "pytorch_model.bin")
  ours = checkpoints.load_checkpoint_model(tmp_path, dtype="float32")
  assert (ours.config.num_encoder_layers, ours.config.num_decoder_layers) == (3, 2)
  assert (ours.config.num_heads, ours.config.head_dim) == (3, 8)
  _assert_logits_parity(ours, reference)


def test_sharded_safetensors_with_index(tmp_path):
  hf = _random_hf_model(4, feed_forward_proj="gated-gelu", tie_word_embeddings=True)
  hf.save_pretrained(tmp_path, max_shard_size="40KB")
  shards = [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]
  assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
  reference = _load_reference(tmp_path)
  ours = checkpoints.load_checkpoint_model(tmp_path, dtype="float32")
  _assert_logits_parity(ours, reference)


def test_export_hf_loads_in_transformers(tmp_path):
  # The reverse direction: our params written as a HF directory give
  # transformers the same logits (T5X init, tied + untied heads).
  for name, overrides in (("untied", {}),
                          ("tied", dict(mlp_activations=("relu",), logits_via_embedding=True))):
    ours = loading.load_model("tiny", vocab_size=VOCAB, dtype="float32", seed=5, **overrides)
    checkpoints.export_hf(ours, tmp_path / name)
    _assert_logits_parity(ours, _load_reference(tmp_path / name))
