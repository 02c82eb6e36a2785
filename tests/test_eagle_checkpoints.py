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
* A loaded head's first proposals are EAGLE-3's own greedy chain (torch).
* Bad directories: each error names its problem.

Negative control (run by hand): letting later queries see the engine's zero
first pair (the head's position-0 mask removed) fails both the torch forward
comparison and the greedy-chain check.
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
DECODE_LAYERS = 3  # decode tests: taps (2, 1, 0), distinct, and a third of the compile time


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


@pytest.mark.slow
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
  apply, to_logits = jax.jit(head.apply), jax.jit(head.logits)
  rng = np.random.default_rng(3)
  batch, pairs, steps = 2, 5, 3
  tokens = rng.integers(0, VOCAB, (batch, pairs + steps)).astype(np.int32)
  features = rng.normal(size=(batch, pairs, head.feature_dim)).astype(np.float32)
  table = torch.tensor(np.asarray(target.params["embed_tokens"]["embedding"]))

  # Ours: the engine's layout (a zero pair at position 0, pair i at position i + 1).
  cache = head.init_cache(params, batch, 1 + pairs + steps)
  zero = jnp.zeros((batch, 1, head.hidden_dim))
  _, cache = apply(params, refs, jnp.asarray(tokens[:, :1]), zero,
                        jnp.zeros((batch,), jnp.int32), cache)
  reduced = head.reduce_features(params, refs, jnp.asarray(features))
  out, cache = apply(params, refs, jnp.asarray(tokens[:, :pairs]), reduced,
                          jnp.ones((batch,), jnp.int32), cache)
  ours_out, ours_logits = [np.asarray(out)], [np.asarray(to_logits(params, refs, out))]
  last = out[:, -1:]
  for i in range(steps):
    out, cache = apply(params, refs, jnp.asarray(tokens[:, pairs + i:pairs + i + 1]), last,
                            jnp.full((batch,), 1 + pairs + i, jnp.int32), cache)
    last = out
    ours_out.append(np.asarray(out))
    ours_logits.append(np.asarray(to_logits(params, refs, out)))
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


@pytest.mark.slow
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
  _, got, _ = family.start_features(target.config, target.params, jnp.asarray(tokens),
                                 jnp.array([7, 7], jnp.int32), 2, "eagle3")
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Directories in the public formats, written here with torch / safetensors.

def _flat(tree):
  from flax import traverse_util
  return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}


def eagle3_config_json(target_config, draft_vocab, **overrides):
  """An EAGLE-3 config.json as the public heads have it (no head_dim, rope_theta: EAGLE's
  defaults apply)."""
  cfg = target_config
  hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg.emb_dim, "intermediate_size": cfg.mlp_dim,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": cfg.norm_epsilon,
        "max_position_embeddings": 2048, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": int(draft_vocab), "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
  hf.update(overrides)
  return hf


def write_eagle3_dir(directory, target, draft_ids, seed=0, drop=(), extra=None, config=None,
                     weights=None):
  """config.json + model.safetensors (safetensors.torch) of a random EAGLE-3 head; returns
  the tensors written (torch)."""
  from safetensors.torch import save_file
  os.makedirs(directory, exist_ok=True)
  cfg = target.config
  w = dict(weights) if weights is not None else random_eagle3_weights(cfg, cfg, len(draft_ids),
                                                                      seed)
  w["d2t"] = torch.tensor(np.asarray(draft_ids) - np.arange(len(draft_ids)), dtype=torch.int64)
  t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
  t2d[torch.tensor(np.asarray(draft_ids), dtype=torch.long)] = True
  w["t2d"] = t2d
  w.update(extra or {})
  for name in drop:
    w.pop(name)
  save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(directory, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config or eagle3_config_json(cfg, len(draft_ids)), f)
  return w


def write_eagle1_dir(directory, target, seed=0, fc_bias=True, drop=(), extra=None, config=None):
  """config.json + pytorch_model.bin (torch.save) of a random EAGLE-1 head."""
  os.makedirs(directory, exist_ok=True)
  cfg = target.config
  gen = torch.Generator().manual_seed(seed)
  h, hd, m = cfg.emb_dim, cfg.head_dim, cfg.mlp_dim

  def normal(*shape):
    return torch.randn(*shape, generator=gen) * 0.3 / np.sqrt(shape[-1])

  w = {"fc.weight": normal(h, 2 * h),
       "layers.0.self_attn.q_proj.weight": normal(cfg.num_heads * hd, h),
       "layers.0.self_attn.k_proj.weight": normal(cfg.num_kv_heads * hd, h),
       "layers.0.self_attn.v_proj.weight": normal(cfg.num_kv_heads * hd, h),
       "layers.0.self_attn.o_proj.weight": normal(h, cfg.num_heads * hd),
       "layers.0.mlp.gate_proj.weight": normal(m, h), "layers.0.mlp.up_proj.weight": normal(m, h),
       "layers.0.mlp.down_proj.weight": normal(h, m),
       "layers.0.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=gen)}
  if fc_bias:
    w["fc.bias"] = 0.1 * torch.randn(h, generator=gen)
  w.update(extra or {})
  for name in drop:
    w.pop(name)
  torch.save(w, os.path.join(directory, "pytorch_model.bin"))
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": m, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "num_hidden_layers": 1,
        "rms_norm_eps": cfg.norm_epsilon, "vocab_size": cfg.vocab_size, "bias": fc_bias,
        "torch_dtype": "float32"}
  hf.update(config or {})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf, f)
  return w


def _assert_tensors_landed(draft, written, names):
  """Every written tensor is the param the format names (kernels = weight.T)."""
  flat = _flat(draft.head_params)
  assert set(flat) == set(names), (sorted(flat), sorted(names))
  for ours, (theirs, transpose) in names.items():
    want = written[theirs].numpy()
    np.testing.assert_array_equal(flat[ours], want.T if transpose else want, err_msg=ours)


@pytest.mark.slow
def test_eagle3_directory_loads_with_every_tensor_in_place(tmp_path):
  from specdec_jax.families.decoder_only.eagle_checkpoints import eagle3_names
  target = _target()
  draft_ids = _draft_ids(VOCAB, 24, seed=4)
  written = write_eagle3_dir(tmp_path / "e3", target, draft_ids, seed=5)
  draft = sj.load_feature_draft(tmp_path / "e3", target)
  assert isinstance(draft.head, Eagle3Head)
  _assert_tensors_landed(draft, written, eagle3_names())
  np.testing.assert_array_equal(draft.head.draft_to_target, draft_ids)
  np.testing.assert_array_equal(draft.head.in_draft_vocab(), written["t2d"].numpy())
  assert draft.params["target"]["embed_tokens"]["embedding"] is (
      target.params["embed_tokens"]["embedding"])  # the target's table, not a copy
  # The head's layer follows its config.json: rope_theta absent -> EAGLE's default 10000.
  assert draft.head.layer_config.rope_theta == 10000.0
  # save_feature_draft writes the same format back, tensor for tensor.
  sj.save_feature_draft(draft, tmp_path / "again")
  again = sj.load_feature_draft(tmp_path / "again", target)
  _assert_tensors_landed(again, written, eagle3_names())
  np.testing.assert_array_equal(again.head.draft_to_target, draft_ids)
  with open(tmp_path / "again" / "config.json") as f:
    hf = json.load(f)
  assert hf["draft_vocab_size"] == 24 and hf["target_hidden_size"] == target.config.emb_dim
  assert hf["architectures"] == ["LlamaForCausalLMEagle3"]


@pytest.mark.slow
def test_eagle1_directory_loads_with_every_tensor_in_place(tmp_path):
  from specdec_jax.families.decoder_only.eagle_checkpoints import eagle1_names
  target = _target(layers=2)
  written = write_eagle1_dir(tmp_path / "e1", target, seed=6,
                             extra={"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
  draft = sj.load_feature_draft(tmp_path / "e1", target)
  assert draft.head.fc_bias
  names = eagle1_names(_flat(draft.head_params))
  assert {theirs for theirs, _ in names.values()} == set(written) - {
      "layers.0.self_attn.rotary_emb.inv_freq"}
  _assert_tensors_landed(draft, written, names)
  sj.save_feature_draft(draft, tmp_path / "again", format="eagle1")
  _assert_tensors_landed(sj.load_feature_draft(tmp_path / "again", target), written, names)
  with pytest.raises(ValueError, match="cannot be written as eagle3"):
    sj.save_feature_draft(draft, tmp_path / "no", format="eagle3")


# ---------------------------------------------------------------------------
# Loaded heads decode exactly, drafting only inside their vocabulary.

def _cast(model, dtype):
  return family_of(model).model_type(
      model.config.replace(dtype=dtype),
      jax.tree_util.tree_map(lambda x: x.astype(dtype), model.params))


class _RecordingDraft(sj.FeatureDraft):
  """A FeatureDraft that reports every proposal (tokens, laws, lengths)."""

  def __init__(self, target, draft, log):
    super().__init__(target, head_params=draft.head_params, head=draft.head)
    self.log = log

  def static_key(self):
    return super().static_key() + (id(self.log),)

  def proposer(self, params, plan):
    chain = super().proposer(params, plan)
    inner = chain.propose

    def propose(rng, state, sequences, lengths, max_drafted=None):
      tokens, probs, limit, state = inner(rng, state, sequences, lengths, max_drafted)
      jax.debug.callback(lambda *a: self.log.append(tuple(np.asarray(x) for x in a)),
                         tokens, probs, limit, ordered=True)
      return tokens, probs, limit, state

    return chain._replace(propose=propose)


def _loaded(tmp_path, target, draft_ids, seed, name="e3"):
  """(the loaded draft, the torch tensors written)."""
  written = write_eagle3_dir(tmp_path / name, target, draft_ids, seed=seed)
  return sj.load_feature_draft(tmp_path / name, target), written


def _eagle3_greedy_chain(weights, target, prompt, draft_ids, gamma):
  """EAGLE-3's own greedy chain after a prompt (torch, float32): pairs (h_t, token_{t+1})
  at positions 0.., the last output's argmax draft id d -> target id d + d2t[d], then
  its output fed back with that token, gamma times. Target features: the family's
  "eagle3" features (checked against transformers in
  test_eagle3_features_are_the_public_layer_inputs)."""
  family = family_of(target)
  n = len(prompt)
  _, features, _ = family.start_features(target.config, target.params, jnp.asarray(prompt[None]),
                                         jnp.array([n], jnp.int32), 2, "eagle3")
  table = torch.tensor(np.asarray(target.params["embed_tokens"]["embedding"], np.float32))
  tokens = list(prompt[1:])
  with torch.no_grad():
    hidden = torch.tensor(np.asarray(features)[:, :n - 1]) @ weights["fc.weight"].T
    drafted = []
    for _ in range(gamma):
      emb = table[torch.tensor(tokens, dtype=torch.long)][None]
      out, logits = torch_eagle3(weights, target.config, emb, hidden,
                                 torch.arange(len(tokens)))
      token = int(draft_ids[int(torch.argmax(logits[0, -1]))])
      drafted.append(token)
      tokens.append(token)
      hidden = torch.cat([hidden, out[:, -1:]], dim=1)
  return drafted


def _prompts(batch, length, vocab, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, (batch, length)).astype(np.int32)
  lengths = rng.integers(1, length + 1, batch).astype(np.int32)
  lengths[0], lengths[1] = length, 1
  return tokens, lengths


_GREEDY = dict(max_decode_steps=20, block_width=8, eos_id=-1)
_TARGET_ONLY = {}


def _target_only(target, tokens, lengths):
  """Target-only greedy sequences, computed once per target dtype (shared by the tests)."""
  key = target.config.dtype
  if key not in _TARGET_ONLY:
    _TARGET_ONLY[key] = np.asarray(sj.generate(target, tokens, lengths, **_GREEDY).sequences)
  return _TARGET_ONLY[key]


def _greedy_target(dtype):
  return _cast(_target(seed=1, layers=DECODE_LAYERS), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_loaded_eagle3_head_greedy_equals_target_only(tmp_path, dtype):
  target = _greedy_target(dtype)
  draft_ids = _draft_ids(VOCAB, 24, seed=7)
  draft, written = _loaded(tmp_path, target, draft_ids, seed=8)
  assert draft.head.layer_config.dtype == dtype and _flat(draft.head_params)[
      "fc/kernel"].dtype == jnp.dtype(dtype)
  tokens, lengths = _prompts(6, 7, VOCAB, seed=3)
  log = []
  got = sj.generate(target, tokens, lengths, draft=_RecordingDraft(target, draft, log), gamma=3,
                    **_GREEDY)
  jax.effects_barrier()
  np.testing.assert_array_equal(np.asarray(got.sequences), _target_only(target, tokens, lengths))
  assert got.stats.iterations.sum() > 0
  outside = np.setdiff1d(np.arange(VOCAB), draft_ids)
  assert log
  for drafted, laws, limit in log:
    for b in range(drafted.shape[0]):
      assert np.isin(drafted[b, :limit[b]], draft_ids).all(), drafted[b]
    np.testing.assert_array_equal(laws[..., outside], 0.0)  # q is zero outside
  if dtype == "float32":
    # The first proposal of each row is EAGLE-3's own greedy chain (rows with at least
    # two prompt tokens: EAGLE has no pair before that).
    first = log[0][0]
    rows = [b for b in range(len(lengths)) if lengths[b] >= 2]
    for b in rows:
      want = _eagle3_greedy_chain(written, target, tokens[b, :lengths[b]], draft_ids, 3)
      assert first[b].tolist() == want, (b, first[b], want)


@pytest.mark.slow
def test_loaded_eagle3_head_samples_follow_target_distribution(tmp_path):
  """Whole 3-token decodes over a vocabulary of 8 (a draft vocabulary of 5), 10,000
  samples at temperature 1, against the exact enumeration of the target's law
  (chi-square at 1e-4, as test_feature_draft.py); every drafted token in the draft
  vocabulary."""
  import test_trees
  from test_speculative import P_VALUE, _chi_square_ok
  n, steps, vocab = 10_000, 3, 8
  target = _target(vocab=vocab, seed=21, layers=DECODE_LAYERS)
  draft_ids = np.array([0, 2, 3, 5, 6])
  draft, _ = _loaded(tmp_path, target, draft_ids, seed=9)
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, steps, eos, temperature=1.0)
  log = []
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    draft=_RecordingDraft(target, draft, log), gamma=2, block_width=3,
                    rng=jax.random.PRNGKey(23), temperature=1.0)
  jax.effects_barrier()
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE
  for drafted, _, limit in log:
    kept = np.arange(drafted.shape[1])[None] < limit[:, None]
    assert np.isin(drafted[kept], draft_ids).all()


@pytest.mark.slow
def test_loaded_eagle1_head_greedy_equals_target_only(tmp_path):
  target = _greedy_target("float32")
  write_eagle1_dir(tmp_path / "e1", target, seed=10)
  draft = sj.load_feature_draft(tmp_path / "e1", target)
  tokens, lengths = _prompts(6, 7, VOCAB, seed=3)
  got = sj.generate(target, tokens, lengths, draft=draft, gamma=3, **_GREEDY)
  np.testing.assert_array_equal(np.asarray(got.sequences), _target_only(target, tokens, lengths))
  assert got.stats.iterations.sum() > 0


@pytest.mark.slow  # make test budget (CI ran it in 17 min); runs in make test-slow
# ---------------------------------------------------------------------------
# Bad directories.

def test_bad_eagle_directories_get_clear_errors(tmp_path):
  target = _target()
  cfg = target.config
  ids = _draft_ids(VOCAB, 24, seed=11)
  load = sj.load_feature_draft
  err = sj.CheckpointError

  def e3(name, **kwargs):
    write_eagle3_dir(tmp_path / name, target, ids, seed=12, **kwargs)
    return tmp_path / name

  with pytest.raises(err, match="no such directory"):
    load(tmp_path / "absent", target)
  os.makedirs(tmp_path / "empty")
  with pytest.raises(err, match="no config.json"):
    load(tmp_path / "empty", target)
  d = e3("noweights")
  os.remove(d / "model.safetensors")
  with pytest.raises(err, match="no weights"):
    load(d, target)
  with pytest.raises(err, match=r"missing \(1\):\n.*midlayer\.mlp\.up_proj\.weight"):
    load(e3("missing", drop=("midlayer.mlp.up_proj.weight",)), target)
  with pytest.raises(err, match=r"unexpected \(1\):\n.*midlayer\.extra\.weight"):
    load(e3("unexpected", extra={"midlayer.extra.weight": torch.ones(3)}), target)
  with pytest.raises(err, match=r"shape mismatch.*\n.*fc\.weight: \(64, 96\) vs expected "
                                r"\(64, 192\)"):
    load(e3("fcwidth", extra={"fc.weight": torch.ones(64, 96)}), target)
  with pytest.raises(err, match="hidden_size 48 differs from the target's hidden size 64 "
                                r"\(DecoderOnlyConfig.emb_dim"):
    load(e3("hidden", config=eagle3_config_json(cfg, 24, hidden_size=48)), target)
  with pytest.raises(err, match="target_hidden_size 128 differs from the target's hidden size 64"):
    load(e3("thidden", config=eagle3_config_json(cfg, 24, target_hidden_size=128)), target)
  with pytest.raises(err, match="vocab_size 100 differs from the target's vocabulary of 64"):
    load(e3("vocab", config=eagle3_config_json(cfg, 24, vocab_size=100)), target)
  with pytest.raises(err, match=r"d2t has shape \(24,\), but draft_vocab_size is 20"):
    load(e3("d2tlen", config=eagle3_config_json(cfg, 20)), target)
  with pytest.raises(err, match=r"t2d has shape \(70,\), but the target's vocabulary has 64"):
    load(e3("t2dlen", extra={"t2d": torch.zeros(70, dtype=torch.bool)}), target)
  far = torch.tensor(ids - np.arange(24), dtype=torch.int64)
  far[3] += 1000
  with pytest.raises(err, match=r"draft ids \[3\] map to target ids \[\d+\], outside the "
                                r"target vocabulary \[0, 64\)"):
    load(e3("outside", extra={"d2t": far}), target)
  twice = torch.tensor(ids - np.arange(24), dtype=torch.int64)
  twice[1] = ids[0] - 1  # draft id 1 -> target id ids[0], as draft id 0
  with pytest.raises(err, match="one-to-one"):
    load(e3("twice", extra={"d2t": twice}), target)
  t2d = torch.zeros(VOCAB, dtype=torch.bool)
  t2d[torch.tensor(ids[1:], dtype=torch.long)] = True
  with pytest.raises(err, match=rf"t2d disagrees with d2t at target ids \[{ids[0]}\]"):
    load(e3("t2d", extra={"t2d": t2d}), target)
  with pytest.raises(err, match="neither an EAGLE-1 head .* nor an EAGLE-3 head"):
    load(e3("neither", drop=[k for k in random_eagle3_weights(cfg, cfg, 24, 0)
                             if k.startswith("midlayer.")]), target)
  d = e3("gpt2")
  with pytest.raises(err, match="a gpt2 target layout is not supported"):
    load(d, sj.load_model("gpt2_tiny", vocab_size=VOCAB))
  with pytest.raises(err, match="decoder-only Llama-layout targets; the target is a T5Config"):
    load(d, sj.load_model("tiny", vocab_size=VOCAB))
  # EAGLE-1: its layer is its config.json's (EAGLE builds it so): weights of another
  # width are a shape mismatch naming the file; biases must agree with the config.
  small = _target(layers=2)
  write_eagle1_dir(tmp_path / "e1mlp", small, config={"intermediate_size": 96})
  with pytest.raises(err, match=r"mlp 96\):\n  shape mismatch \(3\):\n    pytorch_model.bin: "
                                r"layers.0.mlp.down_proj.weight: \(64, 128\) vs expected "
                                r"\(64, 96\)"):
    load(tmp_path / "e1mlp", small)
  write_eagle1_dir(tmp_path / "e1bias", small, fc_bias=False, config={"bias": True})
  with pytest.raises(err, match="bias=True but the weights lack fc.bias"):
    load(tmp_path / "e1bias", small)
  write_eagle1_dir(tmp_path / "e1qkv", small, config={"qkv_bias": True})
  with pytest.raises(err, match=r"lack q/k/v biases .* qkv_bias=True.* \(set it to false\)"):
    load(tmp_path / "e1qkv", small)
  write_eagle1_dir(tmp_path / "e1hd", small, config={"head_dim": 8})
  with pytest.raises(err, match="head_dim 8, but EAGLE's head code computes head_dim = "
                                "hidden_size // num_attention_heads = 16"):
    load(tmp_path / "e1hd", small)
  write_eagle1_dir(tmp_path / "e1rope", small,
                   config={"rope_scaling": {"type": "dynamic", "factor": 2.0}})
  with pytest.raises(err, match="only 'linear' is supported here"):
    load(tmp_path / "e1rope", small)
  write_eagle1_dir(tmp_path / "e1emb", small, extra={"embed_tokens.weight": torch.ones(3, 64)})
  with pytest.raises(err, match=r"embed_tokens.weight: shape \(3, 64\), but the target's "
                                r"embedding table is \(64, 64\)"):
    load(tmp_path / "e1emb", small)
  write_eagle1_dir(tmp_path / "e1miss", small, drop=("layers.0.mlp.down_proj.weight",))
  with pytest.raises(err, match=r"missing \(1\):\n.*layers\.0\.mlp\.down_proj\.weight"):
    load(tmp_path / "e1miss", small)


def test_eagle_heads_refuse_targets_without_rotary_llama_layers():
  """One check (`eagle3_head.check_rotary_target`) words the head's and the loader's error."""
  from specdec_jax.families.decoder_only import eagle_checkpoints
  from specdec_jax.families.tensor_io import CheckpointError
  gpt2 = sj.load_model("gpt2_tiny", vocab_size=VOCAB).config
  t5 = sj.load_model("tiny", vocab_size=VOCAB).config
  for target, message in ((gpt2, "a gpt2 target layout is not supported"),
                          (t5, "Llama-layout targets; the target is a T5Config model")):
    with pytest.raises(ValueError, match=message) as raised:
      Eagle3Head(target)
    assert not isinstance(raised.value, CheckpointError)
    with pytest.raises(CheckpointError, match=message):
      eagle_checkpoints.check_target(target)
  Eagle3Head(_target().config)  # a Llama target is served
