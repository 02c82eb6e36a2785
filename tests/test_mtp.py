"""A checkpoint's own MTP modules as a draft (`sj.MtpDraft`, `sj.load_mtp_draft`).

For each layout (DeepSeek-V3 on a Qwen3-layout body, with two chained modules;
Qwen3-Next on Qwen3; MiMo on Qwen2):

* a directory written here (config.json + safetensors, the checkpoint's own tensor
  names spelled out, the target's own tensors beside them) loads to exactly the
  arrays of the draft built here, and gives the same proposals;
* the first two laws of a proposal match an independent numpy reference of the MTP
  step written from vLLM's `deepseek_mtp.py` / `qwen3_next_mtp.py` / `mimo_mtp.py`
  (the target's hidden state after its final norm, or before it for MiMo; the
  concatenation order; the zeroed embedding at vLLM's position 0; the norm flavours;
  the fed-back state);
* speculative greedy equals target-only greedy in float32 and bfloat16;
* (slow) whole-decode chi-square at temperature 1; a token tree from one module; a
  DeepSeek-V3-layout target (latent attention, MoE) with its own MTP layer;
* bad input gets errors naming what was looked for.
"""

import collections
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.core.sampling import Sampling
from specdec_jax.families.registry import family_of
from specdec_jax.families.tensor_io import write_safetensors

# layout -> (target config, modules, own embedding tables)
CASES = {"deepseek": ("qwen3_tiny", 2, True), "qwen3_next": ("qwen3_tiny", 1, False),
         "mimo": ("qwen2_tiny", 1, False)}
OWN_OFFSET = {"deepseek": 0.0, "qwen3_next": 1.0, "mimo": 0.0}  # x * (offset + w)


def _target(name, vocab=16, seed=3, dtype="float32"):
  target = sj.load_model(name, vocab_size=vocab, seed=seed, dtype="float32")
  if dtype != "float32":
    target = family_of(target).model_type(
        target.config.replace(dtype=dtype),
        jax.tree_util.tree_map(lambda x: x.astype(dtype), target.params))
  return target


def _with_random_norms(target, seed=0):
  """The target with every norm multiplier random around 1 (its final norm's matters to MiMo,
  whose modules read the state before it)."""
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: (1 + 0.3 * rng.standard_normal(x.shape)).astype(x.dtype)
      if getattr(path[-1], "key", None) == "scale" else x, target.params)
  return family_of(target).model_type(target.config, params)


def _inputs(vocab=16, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, (4, 6)).astype(np.int32)
  return tokens, np.array([6, 1, 4, 2], np.int32)  # a one-token prompt too


def _random_modules(draft, seed=0):
  """The draft's module arrays made large enough to matter: kernels x 12, biases and norm
  multipliers random (own norms around the layout's flavour, the layer's around 1)."""
  rng = np.random.default_rng(seed)
  offset = OWN_OFFSET[draft.layout]

  def visit(path, x):
    keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
    x = np.asarray(x, np.float32)
    if keys[-1] == "kernel":
      return x * 12
    if keys[-1] == "embed_tokens":
      return 0.5 * rng.standard_normal(x.shape)
    if keys[-1] == "bias":
      return 0.3 * rng.standard_normal(x.shape)
    if keys[-1] == "scale":
      base = 1.0 if "layer" in keys else 1.0 - offset
      return base + 0.3 * rng.standard_normal(x.shape)
    return x

  params = jax.tree_util.tree_map_with_path(visit, draft.head_params)
  dtype = draft.config.dtype
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)


def _copy_modules(draft, target):
  """Modules that pass the target's state through (proj picks the hidden half, the layer's
  output projections zeroed, every own norm multiplier 1 except MiMo's hidden norm, the
  target's final norm): they draft the target's argmax one position back, i.e. repeats of
  the last token, which random tiny targets accept often."""
  h = target.config.emb_dim
  offset = OWN_OFFSET[draft.layout]
  pick = jnp.eye(h)
  modules = []
  for module in draft.head_params["modules"]:
    module = jax.tree_util.tree_map(lambda x: x, module)
    halves = [pick, jnp.zeros((h, h))] if draft.layout == "mimo" else [jnp.zeros((h, h)), pick]
    module["proj"]["kernel"] = jnp.concatenate(halves)
    for name in ("token_norm", "hidden_norm", "final_norm"):
      module[name]["scale"] = jnp.full((h,), 1.0 - offset)
    if draft.layout == "mimo":
      module["hidden_norm"]["scale"] = target.params["norm"]["scale"]
    if "head" in module:  # DeepSeek's own head: the target's (tied) output
      module["head"]["kernel"] = target.params["embed_tokens"]["embedding"].T
    layer = module["layer"]
    layer["self_attn"]["o_proj"]["kernel"] = jnp.zeros_like(layer["self_attn"]["o_proj"]["kernel"])
    layer["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layer["mlp"]["down_proj"]["kernel"])
    modules.append(module)
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, target.config.dtype),
                                  dict(modules=modules))
  return sj.MtpDraft(target, draft.layout, draft.num_modules, params=params,
                     own_embeddings=draft.head.own_embeddings)


# ---------------------------------------------------------------------------
# The checkpoint's own names, written here.

def _layer_tensors(layer, prefix, config):
  """A Qwen2 / Qwen3 decoder layer under its checkpoint prefix (HF [out, in] weights)."""
  out = {prefix + "input_layernorm.weight": layer["input_layernorm"]["scale"],
         prefix + "post_attention_layernorm.weight": layer["post_attention_layernorm"]["scale"]}
  for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
    out[f"{prefix}self_attn.{proj}.weight"] = np.asarray(layer["self_attn"][proj]["kernel"]).T
    if "bias" in layer["self_attn"][proj]:
      out[f"{prefix}self_attn.{proj}.bias"] = layer["self_attn"][proj]["bias"]
  if config.qk_norm:
    for norm in ("q_norm", "k_norm"):
      out[f"{prefix}self_attn.{norm}.weight"] = layer["self_attn"][norm]["scale"]
  for proj in ("gate_proj", "up_proj", "down_proj"):
    out[f"{prefix}mlp.{proj}.weight"] = np.asarray(layer["mlp"][proj]["kernel"]).T
  return out


def _tensors(draft, target):
  """{checkpoint name: array} of the draft's modules in its layout, plus a few of the
  target's own tensors (which the loader leaves alone)."""
  config, L = target.config, target.config.num_layers
  tensors = {"model.embed_tokens.weight": target.params["embed_tokens"]["embedding"],
             "model.norm.weight": target.params["norm"]["scale"],
             "model.layers.0.input_layernorm.weight":
                 target.params["layers_0"]["input_layernorm"]["scale"]}
  for k, m in enumerate(draft.head_params["modules"]):
    if draft.layout == "deepseek":
      p = f"model.layers.{L + k}."
      tensors.update({p + "enorm.weight": m["token_norm"]["scale"],
                      p + "hnorm.weight": m["hidden_norm"]["scale"],
                      p + "eh_proj.weight": np.asarray(m["proj"]["kernel"]).T,
                      p + "shared_head.norm.weight": m["final_norm"]["scale"],
                      p + "shared_head.head.weight": np.asarray(m["head"]["kernel"]).T,
                      # DeepSeek-V3 stores the embedding with the module too (its own
                      # table where the draft has one, else a copy of the target's).
                      p + "embed_tokens.weight": m.get(
                          "embed_tokens", target.params["embed_tokens"]["embedding"])})
      tensors.update(_layer_tensors(m["layer"], p, config))
    elif draft.layout == "qwen3_next":
      tensors.update({"mtp.pre_fc_norm_embedding.weight": m["token_norm"]["scale"],
                      "mtp.pre_fc_norm_hidden.weight": m["hidden_norm"]["scale"],
                      "mtp.fc.weight": np.asarray(m["proj"]["kernel"]).T,
                      "mtp.norm.weight": m["final_norm"]["scale"]})
      tensors.update(_layer_tensors(m["layer"], f"mtp.layers.{k}.", config))
    else:
      p = f"model.mtp_layers.{k}."
      tensors.update({p + "token_layernorm.weight": m["token_norm"]["scale"],
                      p + "hidden_layernorm.weight": m["hidden_norm"]["scale"],
                      p + "input_proj.weight": np.asarray(m["proj"]["kernel"]).T,
                      p + "final_layernorm.weight": m["final_norm"]["scale"]})
      tensors.update(_layer_tensors(m["layer"], p, config))
  return {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def _write(directory, tensors, hf):
  os.makedirs(directory, exist_ok=True)
  write_safetensors(os.path.join(directory, "model.safetensors"),
                    [(k, v.shape, v.dtype, lambda v=v: v) for k, v in sorted(tensors.items())])
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf, f)


def _config_json(draft, target, **changes):
  config = target.config
  hf = dict(hidden_size=config.emb_dim, vocab_size=config.vocab_size,
            num_hidden_layers=config.num_layers)
  key = "mtp_num_hidden_layers" if draft.layout == "qwen3_next" else "num_nextn_predict_layers"
  hf[key] = draft.num_modules
  hf.update(changes)
  return hf


# ---------------------------------------------------------------------------
# An independent numpy reference (vLLM's MTP step) and the draft's first laws.

def _np(tree):
  return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), tree)


def _rms(x, w, eps, offset=0.0):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (offset + w)


def _rotate(x, positions, theta):
  d = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
  angles = positions[:, None] * inv
  cos = np.cos(np.concatenate([angles, angles], -1))[:, None]
  sin = np.sin(np.concatenate([angles, angles], -1))[:, None]
  half = d // 2
  return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def _layer(p, x, positions, config):
  """A Qwen2 / Qwen3 decoder layer over one sequence x [T, h], causal, rotary at positions."""
  eps, heads, kv, d = config.norm_epsilon, config.num_heads, config.num_kv_heads, config.head_dim
  a = p["self_attn"]

  def proj(name, y):
    out = y @ a[name]["kernel"]
    return out + a[name]["bias"] if "bias" in a[name] else out

  y = _rms(x, p["input_layernorm"]["scale"], eps)
  q = proj("q_proj", y).reshape(len(x), heads, d)
  k = proj("k_proj", y).reshape(len(x), kv, d)
  v = proj("v_proj", y).reshape(len(x), kv, d)
  if config.qk_norm:
    q, k = _rms(q, a["q_norm"]["scale"], eps), _rms(k, a["k_norm"]["scale"], eps)
  q, k = _rotate(q, positions, config.rope_theta), _rotate(k, positions, config.rope_theta)
  k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
  scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
  scores = np.where(np.tril(np.ones((len(x), len(x)), bool)), scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  attended = np.einsum("hqk,khd->qhd", weights, v).reshape(len(x), heads * d)
  x = x + attended @ a["o_proj"]["kernel"]
  y = _rms(x, p["post_attention_layernorm"]["scale"], eps)
  m = p["mlp"]
  gate = y @ m["gate_proj"]["kernel"]
  return x + (gate / (1 + np.exp(-gate)) * (y @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]


def _target_hidden(target, tokens):
  """(before the final norm, after it) [T, h] of one prompt, in numpy."""
  p, config = _np(target.params), target.config
  x = p["embed_tokens"]["embedding"][tokens]
  for i in range(config.num_layers):
    x = _layer(p[f"layers_{i}"], x, np.arange(len(tokens)), config)
  return x, _rms(x, p["norm"]["scale"], config.norm_epsilon)


def _reference_laws(draft, target, prompt, d1):
  """vLLM's MTP step over one prompt x_0..x_{L-1}: pairs (h_p, x_{p+1}) at positions p =
  0..L-2 (h: the target's state after its final norm; MiMo: before), then step 2 at p = L-1
  with the module output fed back and the drafted token d1. Laws at temperature 1."""
  config, layout = target.config, draft.layout
  eps, off = config.norm_epsilon, OWN_OFFSET[layout]
  table = np.asarray(target.params["embed_tokens"]["embedding"], np.float32)
  pre, post = _target_hidden(target, prompt)
  modules = _np(draft.head_params)["modules"]

  def run(m, hidden, tokens):
    positions = np.arange(len(tokens))
    e = m.get("embed_tokens", table)[tokens].copy()
    if layout in ("deepseek", "mimo"):
      e[positions == 0] = 0  # vLLM: inputs_embeds[positions == 0] = 0
    e = _rms(e, m["token_norm"]["scale"], eps, off)
    h = _rms(hidden, m["hidden_norm"]["scale"], eps, off)
    cat = np.concatenate([h, e] if layout == "mimo" else [e, h], -1)
    y = _layer(m["layer"], cat @ m["proj"]["kernel"], positions, config)
    if layout == "deepseek":  # fed back: the layer's output; logits: shared_head
      return y, _rms(y, m["final_norm"]["scale"], eps) @ m["head"]["kernel"]
    y = _rms(y, m["final_norm"]["scale"], eps, off)  # mtp.norm / final_layernorm
    return y, y @ table.T  # the target's (tied) LM head

  def softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()

  hidden = pre if layout == "mimo" else post
  L = len(prompt)
  out, logits = run(modules[0], hidden[:L - 1], prompt[1:])
  second = modules[1 % len(modules)]
  _, logits2 = run(second, np.concatenate([hidden[:L - 1], out[-1:]]),
                   np.concatenate([prompt[1:], [d1]]))
  return softmax(logits[-1]), softmax(logits2[-1])


class _Static:
  """A draft and its target as a jit static argument: equal static keys share a compile, as
  in the engine (a loaded draft runs the program traced for the built one)."""

  def __init__(self, draft, target):
    self.draft, self.target = draft, target

  def key(self):
    return (self.draft.static_key(), self.target.config)

  def __hash__(self):
    return hash(self.key())

  def __eq__(self, other):
    return self.key() == other.key()


@functools.partial(jax.jit, static_argnums=(0, 5))
def _propose_once(static, params, target_params, tokens, lengths, gamma):
  draft, target = static.draft, static.target
  family = family_of(target)
  steps = 8
  decode, features, memory = family.start_features(target.config, target_params, tokens,
                                                   lengths, steps, draft.reads.layers)
  start = sj.DraftStart(family.context(tokens, lengths), steps, gamma, features=features,
                        memory=memory, decode=decode)
  state = draft.init_state(params, start)
  chain = draft.proposer(params, sj.ProposalPlan(Sampling(1.0), gamma, gamma + 1))
  batch = tokens.shape[0]
  drafted, laws, _, _ = chain.propose(jax.random.PRNGKey(5), state,
                                      jnp.zeros((batch, 16), jnp.int32),
                                      jnp.zeros((batch,), jnp.int32))
  return drafted, laws


def _first_laws(draft, target, tokens, lengths, gamma=2):
  """One proposal after the prompt at temperature 1: (tokens [b, gamma], laws)."""
  drafted, laws = _propose_once(_Static(draft, target), draft.params, target.params,
                                jnp.asarray(tokens), jnp.asarray(lengths), gamma)
  return np.asarray(drafted), np.asarray(laws)


# ---------------------------------------------------------------------------
# 1. Loading, and the math.

@pytest.mark.parametrize("layout", list(CASES))
def test_checkpoint_modules_load_to_the_same_draft_and_match_the_reference(tmp_path, layout):
  name, n, own = CASES[layout]
  target = _with_random_norms(_target(name))
  built = sj.MtpDraft(target, layout, num_modules=n, seed=1, own_embeddings=own)
  built = sj.MtpDraft(target, layout, num_modules=n, params=_random_modules(built, seed=2),
                      own_embeddings=own)
  _write(tmp_path / "m", _tensors(built, target), _config_json(built, target))
  loaded = sj.load_mtp_draft(tmp_path / "m", target)
  assert (loaded.layout, loaded.num_modules, loaded.head.own_embeddings) == (layout, n, own)
  assert loaded.static_key() == built.static_key()
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.head_params, built.head_params)
  tokens, lengths = _inputs()
  drafted, laws = _first_laws(loaded, target, tokens, lengths)
  drafted_built, laws_built = _first_laws(built, target, tokens, lengths)
  np.testing.assert_array_equal(drafted, drafted_built)
  np.testing.assert_array_equal(laws, laws_built)
  for b in np.flatnonzero(lengths >= 2):
    want1, want2 = _reference_laws(built, target, tokens[b, :lengths[b]], drafted[b, 0])
    np.testing.assert_allclose(laws[b, 0], want1, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(laws[b, 1], want2, rtol=2e-4, atol=2e-6)
  assert np.std(laws[:, 0]) > 1e-3  # the modules matter


# ---------------------------------------------------------------------------
# 2. Exactness through the engine.

# Fast: DeepSeek's two chained modules in float32, MiMo's pre-norm reading in bfloat16 (every
# layout's math is checked against the reference above); the other four: `make test-slow`.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("layout,dtype", [
    ("deepseek", "float32"), ("mimo", "bfloat16"),
    pytest.param("qwen3_next", "float32", marks=_SLOW),
    pytest.param("mimo", "float32", marks=_SLOW),
    pytest.param("deepseek", "bfloat16", marks=_SLOW),
    pytest.param("qwen3_next", "bfloat16", marks=_SLOW)])
def test_greedy_with_mtp_modules_equals_target_only(layout, dtype):
  name, n, _ = CASES[layout]
  target = _target(name, dtype=dtype)
  draft = _copy_modules(sj.MtpDraft(target, layout, num_modules=n, seed=1), target)
  tokens, lengths = _inputs()
  kwargs = dict(max_decode_steps=12, eos_id=-1, block_width=4)
  want = sj.generate(target, tokens, lengths, **kwargs)
  got = sj.generate(target, tokens, lengths, draft=draft, gamma=3, **kwargs)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert got.stats.accepted.sum() > 0, got.stats.summary()


@pytest.mark.slow
def test_greedy_token_tree_from_one_mtp_module_equals_target_only():
  target = _target("qwen3_tiny")
  draft = _copy_modules(sj.MtpDraft(target, "qwen3_next", seed=1), target)
  tokens, lengths = _inputs()
  kwargs = dict(max_decode_steps=12, eos_id=-1, block_width=8)
  want = sj.generate(target, tokens, lengths, **kwargs)
  got = sj.generate(target, tokens, lengths, draft=sj.TreeDraft(draft, (2, 2)), **kwargs)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert got.stats.accepted.sum() > 0, got.stats.summary()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["deepseek", "mimo"])
def test_mtp_samples_follow_target_distribution(layout):
  """Whole 3-token decodes over a vocabulary of 8 after a 3-token prompt, 10,000 samples,
  against the exact enumeration of the target's law (chi-square at p 1e-4), with the
  test's power computed as in test_medusa.py (`_power`) and asserted."""
  import test_trees
  from test_medusa import _power
  from test_speculative import P_VALUE, _chi_square_ok
  n, steps = 10_000, 3
  target = sj.load_model("qwen2_tiny" if layout == "mimo" else "llama_tiny", vocab_size=8,
                         seed=21, dtype="float32")
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, steps, eos, temperature=1.0)
  df, effect = _power(expected, n)
  assert effect < 0.025, (df, effect)
  draft = sj.MtpDraft(target, layout, num_modules=2 if layout == "deepseek" else 1, seed=5)
  draft = sj.MtpDraft(target, layout, draft.num_modules, params=_random_modules(draft, 6))
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    draft=draft, gamma=2, block_width=3, rng=jax.random.PRNGKey(23),
                    temperature=1.0)
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


@pytest.mark.slow
def test_a_deepseek_v3_target_drafts_with_its_latent_attention_moe_mtp_layer(tmp_path):
  """The DeepSeek-V3 layout itself: module 0 is the target's own layer kind at index L (latent
  attention, a routed MoE with a shared expert), read under its checkpoint names (the
  family's, for layer L) and drafting exactly."""
  from flax import traverse_util
  from specdec_jax.families.decoder_only import checkpoints
  try:
    target = _target("deepseek_v3_tiny")
  except ValueError as e:  # the family has no DeepSeek-V3 layout
    pytest.skip(str(e))
  L = target.config.num_layers
  draft = sj.MtpDraft(target, "deepseek", seed=1)
  assert draft.head.moe == (True,)
  module = draft.head_params["modules"][0]
  layer = traverse_util.flatten_dict(module["layer"], sep="/")
  tensors = {}
  for key, (name, transform, _) in checkpoints.hf_names(draft.head.extended).items():
    if key.startswith(f"layers_{L}/"):
      array = np.asarray(layer[key[len(f"layers_{L}/"):]], np.float32)
      tensors[name] = array.T if transform == "transpose" else array
  for key, (per_expert, _) in checkpoints.hf_expert_names(draft.head.extended).items():
    if key.startswith(f"layers_{L}/"):
      stacked = np.asarray(layer[key[len(f"layers_{L}/"):]], np.float32)
      tensors.update({name: stacked[e].T for e, name in enumerate(per_expert)})
  assert f"model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight" in tensors
  p = f"model.layers.{L}."
  tensors.update({p + "enorm.weight": module["token_norm"]["scale"],
                  p + "hnorm.weight": module["hidden_norm"]["scale"],
                  p + "eh_proj.weight": np.asarray(module["proj"]["kernel"]).T,
                  p + "shared_head.norm.weight": module["final_norm"]["scale"],
                  p + "shared_head.head.weight": np.asarray(module["head"]["kernel"]).T})
  _write(tmp_path / "ds", {k: np.asarray(v, np.float32) for k, v in tensors.items()},
         _config_json(draft, target))
  loaded = sj.load_mtp_draft(tmp_path / "ds", target)
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.head_params, draft.head_params)
  tokens, lengths = _inputs()
  kwargs = dict(max_decode_steps=10, eos_id=-1, block_width=4)
  want = sj.generate(target, tokens, lengths, **kwargs)
  got = sj.generate(target, tokens, lengths, draft=loaded, gamma=3, **kwargs)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))


# ---------------------------------------------------------------------------
# 3. Bad input.

def test_bad_mtp_input_gets_clear_errors(tmp_path):
  target = _target("qwen3_tiny")
  draft = sj.MtpDraft(target, "deepseek", seed=1)
  tensors = _tensors(draft, target)
  hf = _config_json(draft, target)
  # A module's copy of the target's own embedding table is the target's (no own table).
  _write(tmp_path / "ok", tensors, hf)
  assert not sj.load_mtp_draft(tmp_path / "ok", target).head.own_embeddings
  # No MTP modules: every layout's keys and prefixes named.
  _write(tmp_path / "none", {k: v for k, v in tensors.items() if ".layers.2." not in k},
         dict(hf, num_nextn_predict_layers=None))
  with pytest.raises(sj.CheckpointError, match=r"no MTP modules found[\s\S]*"
                     r"num_nextn_predict_layers >= 1 and tensors model.layers.\{L \+ k\}"
                     r"[\s\S]*mtp.fc, mtp.pre_fc_norm_embedding[\s\S]*mtp_num_hidden_layers"
                     r"[\s\S]*model.mtp_layers.\{k\}[\s\S]*L = 2"):
    sj.load_mtp_draft(tmp_path / "none", target)
  _write(tmp_path / "hidden", tensors, dict(hf, hidden_size=48))
  with pytest.raises(sj.CheckpointError, match="hidden_size 48 differs from the target's 64"):
    sj.load_mtp_draft(tmp_path / "hidden", target)
  _write(tmp_path / "vocab", tensors, dict(hf, vocab_size=24))
  with pytest.raises(sj.CheckpointError, match="vocab_size 24 differs from the target's 16"):
    sj.load_mtp_draft(tmp_path / "vocab", target)
  _write(tmp_path / "depth", tensors, dict(hf, num_hidden_layers=3))
  with pytest.raises(sj.CheckpointError, match="num_hidden_layers 3 differs from the "
                                               "target's 2"):
    sj.load_mtp_draft(tmp_path / "depth", target)
  broken = {k: v for k, v in tensors.items() if not k.endswith("enorm.weight")}
  broken["model.layers.2.eh_proj.weight"] = np.zeros((64, 96), np.float32)
  broken["model.layers.3.enorm.weight"] = np.ones(64, np.float32)
  _write(tmp_path / "broken", broken, hf)
  with pytest.raises(sj.CheckpointError, match=r"\(deepseek, 1 module, hidden 64, vocabulary "
                     r"16\) do not match the target:\n  missing \(1\):\n    model.layers.2.enorm"
                     r".weight[\s\S]*unexpected \(1\):\n    model.safetensors: model.layers.3."
                     r"enorm.weight\n  shape mismatch \(1\):\n    model.safetensors: model.layers"
                     r".2.eh_proj.weight: \(64, 96\) vs expected \(64, 128\)"):
    sj.load_mtp_draft(tmp_path / "broken", target)
  # Models without weights where the error comes before any array is read.
  from specdec_jax.families.decoder_only.config import get_decoder_config
  from specdec_jax.families.registry import families
  no_modules = dict(modules=[])
  with pytest.raises(ValueError, match="MTP layout must be one of"):
    sj.MtpDraft(target, "medusa", params=no_modules)
  gpt2 = family_of(target).model_type(get_decoder_config("gpt2_tiny"), None)
  with pytest.raises(ValueError, match="rotary RMSNorm targets"):
    sj.MtpDraft(gpt2, "deepseek", params=no_modules)
  t5_family = next(f for f in families() if f.name == "t5")
  t5 = t5_family.model_type(t5_family.lookup_config("tiny"), None)
  with pytest.raises(TypeError, match="the target is a t5 model"):
    sj.MtpDraft(t5, "deepseek", params=no_modules)
  with pytest.raises(ValueError, match="built for another target config"):
    draft.check_compatible(target.config.replace(vocab_size=24))  # what `generate` asks
  two = sj.MtpDraft(target, "deepseek", num_modules=2, params=no_modules)
  with pytest.raises(TypeError, match="grown from a single MTP module"):
    two.tree_expander(two.params, Sampling())
  # MiMo reads the state before the final norm: a zero multiplier there loses it.
  params = jax.tree_util.tree_map(lambda x: x, target.params)
  params["norm"]["scale"] = params["norm"]["scale"].at[3].set(0.0)
  with pytest.raises(ValueError, match=r"final norm multiplier is 0 at \[3\]"):
    sj.MtpDraft(family_of(target).model_type(target.config, params), "mimo", params=no_modules)
