"""EAGLE-3 heads and public EAGLE-1 / EAGLE-3 checkpoints (issue 23, items 2 and 5).

* The EAGLE-3 head's forward against a torch transcription of the public
  EAGLE-3 code (SafeAILab/EAGLE `cnets.py` `Model.forward` /
  `LlamaDecoderLayeremb`, at EAGLE's own positions, without our zero pair),
  float32 to 1e-5, including the fed-back steps (its own output, no fc).
* The target's "eagle3" features against transformers' `hidden_states[2, L//2, L-3]`.
* Round trips: EAGLE-3 (model.safetensors written with safetensors.torch, a
  reduced draft vocabulary with d2t / t2d) and EAGLE-1 (pytorch_model.bin
  written with torch.save) directories, random weights, a tiny Llama target:
  every tensor lands where the format says; decoding is exactly the target's
  (greedy identity in float32 and bfloat16, chi-square at temperature 1);
  drafted tokens lie in the draft vocabulary; `save_feature_draft` writes what
  `load_feature_draft` reads.
* Bad directories: each error names its problem.
"""

import collections
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.decoder_only.eagle3_head import Eagle3Head
from specdec_jax.families.registry import family_of

torch = pytest.importorskip("torch")

VOCAB, LAYERS = 64, 8  # 8 layers: the EAGLE-3 taps (2, 4, 5) are distinct


def _target(vocab=VOCAB, seed=0, dtype="float32", layers=LAYERS):
  return sj.load_model("llama_tiny", vocab_size=vocab, seed=seed, dtype=dtype, num_layers=layers)


def _draft_ids(vocab, size, seed):
  """A sorted random subset of target ids (EAGLE-3 keeps the most frequent, sorted)."""
  rng = np.random.default_rng(seed)
  return np.sort(rng.choice(vocab, size, replace=False)).astype(np.int64)


# ---------------------------------------------------------------------------
# A torch transcription of the public EAGLE-3 head (HF Linear layouts).

def _rms(x, w, eps):
  x32 = x.float()
  return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
  half = x.shape[-1] // 2
  return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_eagle3(w, cfg, embeddings, hidden, position_ids):
  """EAGLE-3's `Model.forward` over one sequence of pairs, no cache (causal over them).

  w: HF tensor name -> torch float32 tensor; embeddings [B, T, h]; hidden [B, T, 3H]
  (through fc) or [B, T, h] (fed back as it is); position_ids [T]. Returns the
  midlayer output [B, T, h] (pre-norm) and the draft-vocabulary logits [B, T, D].
  """
  eps, heads, kv, hd = cfg.norm_epsilon, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if hidden.shape[-1] != embeddings.shape[-1]:
    hidden = hidden @ w["fc.weight"].T
  b, t, _ = hidden.shape
  residual = hidden
  x = torch.cat([_rms(embeddings, w["midlayer.input_layernorm.weight"], eps),
                 _rms(hidden, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
  q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(b, t, heads, hd).transpose(1, 2)
  k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
  v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
  inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
  freqs = position_ids.double()[:, None] * inv_freq[None]
  emb = torch.cat([freqs, freqs], dim=-1)
  cos, sin = emb.cos().float(), emb.sin().float()
  q = q * cos + _rotate_half(q) * sin
  k = k * cos + _rotate_half(k) * sin
  k = k.repeat_interleave(heads // kv, dim=1)
  v = v.repeat_interleave(heads // kv, dim=1)
  scores = q @ k.transpose(2, 3) / np.sqrt(hd)
  causal = torch.ones(t, t, dtype=torch.bool).tril()
  scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
  attn = torch.softmax(scores, dim=-1) @ v
  attn = attn.transpose(1, 2).reshape(b, t, heads * hd) @ w["midlayer.self_attn.o_proj.weight"].T
  x = residual + attn
  y = _rms(x, w["midlayer.post_attention_layernorm.weight"], eps)
  y = torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (
      y @ w["midlayer.mlp.up_proj.weight"].T)
  out = x + y @ w["midlayer.mlp.down_proj.weight"].T
  logits = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
  return out, logits


def random_eagle3_weights(target_config, head_config, draft_vocab, seed, scale=0.3):
  """HF-named EAGLE-3 tensors (torch float32), random; norms around 1."""
  gen = torch.Generator().manual_seed(seed)
  h, big_h = head_config.emb_dim, target_config.emb_dim
  hd, heads, kv, m = (head_config.head_dim, head_config.num_heads, head_config.num_kv_heads,
                      head_config.mlp_dim)

  def normal(*shape):
    return torch.randn(*shape, generator=gen) * scale / np.sqrt(shape[-1])

  w = {"fc.weight": normal(h, 3 * big_h),
       "midlayer.self_attn.q_proj.weight": normal(heads * hd, 2 * h),
       "midlayer.self_attn.k_proj.weight": normal(kv * hd, 2 * h),
       "midlayer.self_attn.v_proj.weight": normal(kv * hd, 2 * h),
       "midlayer.self_attn.o_proj.weight": normal(h, heads * hd),
       "midlayer.mlp.gate_proj.weight": normal(m, h), "midlayer.mlp.up_proj.weight": normal(m, h),
       "midlayer.mlp.down_proj.weight": normal(h, m),
       "lm_head.weight": normal(draft_vocab, h) * 10}
  for name in ("midlayer.hidden_norm", "midlayer.input_layernorm",
               "midlayer.post_attention_layernorm", "norm"):
    w[f"{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
  return w


def _head_and_params(target, weights, draft_ids):
  """Our head with the torch weights placed by hand (kernels = weight.T): independent of
  the loader, whose placement the round trip checks separately."""
  from specdec_jax.families.decoder_only.eagle_checkpoints import eagle3_names
  head = Eagle3Head(target.config, draft_to_target=draft_ids)
  params = {}
  for ours, (theirs, transpose) in eagle3_names().items():
    array = weights[theirs].numpy()
    node = params
    *path, leaf = ours.split("/")
    for key in path:
      node = node.setdefault(key, {})
    node[leaf] = jnp.asarray(array.T if transpose else array)
  return head, params


def test_eagle3_head_matches_the_public_code_transcribed_in_torch():
  """Prompt pairs (h_t, token_{t+1}) in one block, then 3 drafting steps that feed the
  head's own output back: out and logits to 1e-5 (float32); target-vocab logits are
  the draft logits at d + d2t[d] and -inf elsewhere."""
  target = _target()
  cfg = target.config
  draft_ids = _draft_ids(VOCAB, 24, seed=1)
  weights = random_eagle3_weights(cfg, cfg, draft_ids.size, seed=2)
  head, params = _head_and_params(target, weights, draft_ids)
  refs = head.target_refs(target.params)
  rng = np.random.default_rng(3)
  batch, pairs, steps = 2, 5, 3
  tokens = rng.integers(0, VOCAB, (batch, pairs + steps)).astype(np.int32)
  features = rng.normal(size=(batch, pairs, head.feature_dim)).astype(np.float32)
  table = torch.tensor(np.asarray(target.params["embed_tokens"]["embedding"]))

  # Ours: the engine's layout (a zero pair at position 0, pair i at position i + 1).
  cache = head.init_cache(params, batch, 1 + pairs + steps)
  zero = jnp.zeros((batch, 1, head.hidden_dim))
  _, cache = head.apply(params, refs, jnp.asarray(tokens[:, :1]), zero,
                        jnp.zeros((batch,), jnp.int32), cache)
  reduced = head.reduce_features(params, refs, jnp.asarray(features))
  out, cache = head.apply(params, refs, jnp.asarray(tokens[:, :pairs]), reduced,
                          jnp.ones((batch,), jnp.int32), cache)
  ours_out, ours_logits = [np.asarray(out)], [np.asarray(head.logits(params, refs, out))]
  last = out[:, -1:]
  for i in range(steps):
    out, cache = head.apply(params, refs, jnp.asarray(tokens[:, pairs + i:pairs + i + 1]), last,
                            jnp.full((batch,), 1 + pairs + i, jnp.int32), cache)
    last = out
    ours_out.append(np.asarray(out))
    ours_logits.append(np.asarray(head.logits(params, refs, out)))
  ours_out = np.concatenate(ours_out, axis=1)
  ours_logits = np.concatenate(ours_logits, axis=1)

  # The reference: EAGLE's positions 0, 1, ...; each step reruns the whole sequence
  # with the fed-back hidden states in place of features (no cache).
  with torch.no_grad():
    emb = table[torch.tensor(tokens, dtype=torch.long)]
    hidden = torch.tensor(features) @ weights["fc.weight"].T
    want_out, want_logits = torch_eagle3(weights, cfg, emb[:, :pairs], hidden,
                                         torch.arange(pairs))
    for i in range(steps):
      hidden = torch.cat([hidden, want_out[:, -1:]], dim=1)
      n = pairs + i + 1
      step_out, step_logits = torch_eagle3(weights, cfg, emb[:, :n], hidden, torch.arange(n))
      want_out = torch.cat([want_out, step_out[:, -1:]], dim=1)
      want_logits = torch.cat([want_logits, step_logits[:, -1:]], dim=1)
  np.testing.assert_allclose(ours_out, want_out.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours_logits[..., draft_ids], want_logits.numpy(), rtol=1e-5,
                             atol=1e-5)
  outside = np.setdiff1d(np.arange(VOCAB), draft_ids)
  assert np.all(np.isneginf(ours_logits[..., outside]))
  assert np.std(want_logits.numpy()) > 0.1  # Not a degenerate comparison.


def test_eagle3_features_are_the_public_layer_inputs():
  """The target's "eagle3" features = transformers' hidden_states[2], [L//2], [L-3]
  (the inputs of those layers), concatenated in that order, as EAGLE-3's code takes."""
  transformers = pytest.importorskip("transformers")
  import tempfile
  target = _target()
  with tempfile.TemporaryDirectory() as d:
    sj.export_hf(target, d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 7)).astype(np.int32)
  with torch.no_grad():
    states = hf(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True).hidden_states
  want = torch.cat([states[2], states[LAYERS // 2], states[LAYERS - 3]], dim=-1).numpy()
  family = family_of(target)
  _, got = family.start_features(target.config, target.params, jnp.asarray(tokens),
                                 jnp.array([7, 7], jnp.int32), 2, "eagle3")
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
