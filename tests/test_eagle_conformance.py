"""Heads read from EAGLE checkpoints compute what EAGLE's own code computes (issue 35).

EAGLE's modules (SafeAILab/EAGLE `eagle/model/cnets1.py` `Model`, EAGLE-1,
and `cnets.py` `Model`, EAGLE-3, at cb7e084) come unmodified from
SPECDEC_EAGLE_PATH (default ../shared/third_party beside the repository);
without them, or without torch / transformers, these tests skip, saying why.

Each case builds a head with EAGLE's own module, writes its `state_dict()` in
the public layout (config.json + pytorch_model.bin or model.safetensors, with
or without d2t/t2d, embed_tokens and fc.bias), loads it with
`sj.load_feature_draft`, and checks, on a tiny random target (exported to
transformers, whose hidden states EAGLE's modules read):

* logits at every position against EAGLE's `forward` (float32, 1e-4);
* the first proposed chain, token for token, against EAGLE's own
  `topK_genrate` with top_k = 1 (a chain);
* greedy identity through `sj.generate`;
* in bfloat16: drafted tokens equal EAGLE's float32 argmax wherever its
  top-2 margin exceeds the bf16 error bound, and greedy identity.

The head's layer settings deliberately differ from the target's (heads,
intermediate size, eps, rotary base), so a head built from the target's
config instead of its own fails these tests; so does a head that lets later
queries see the engine's zero first pair (`families.feature_head.pair_visible`).
"""

import json
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.feature_head import eagle3_taps
from specdec_jax.families.registry import family_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EAGLE_PATH = os.path.abspath(os.environ.get("SPECDEC_EAGLE_PATH",
                                            os.path.join(REPO, "..", "shared", "third_party")))


def _eagle_rule_taps(num_layers):
  """EAGLE-3's taps written as its target code takes them (modeling_llama_kv.py:
  `if idx==len(self.layers)-3 or idx==len(self.layers)//2 or idx==2`)."""
  return tuple(idx for idx in range(num_layers)
               if idx == num_layers - 3 or idx == num_layers // 2 or idx == 2)


def test_eagle3_taps_follow_eagles_rule_or_fail_clearly():
  for num_layers in range(1, 40):
    want = _eagle_rule_taps(num_layers)
    if len(want) == 3:
      assert eagle3_taps(num_layers) == want, num_layers
    else:
      with pytest.raises(ValueError, match=f"this target has {num_layers} "):
        eagle3_taps(num_layers)
  assert eagle3_taps(3) == (0, 1, 2) and eagle3_taps(32) == (2, 16, 29)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _import_eagle():
  if not os.path.isdir(os.path.join(EAGLE_PATH, "eagle")):
    pytest.skip(f"EAGLE's sources are not at {EAGLE_PATH}/eagle (set SPECDEC_EAGLE_PATH to the "
                f"folder holding SafeAILab/EAGLE's eagle/model files as eagle/)",
                allow_module_level=True)
  if EAGLE_PATH not in sys.path:
    sys.path.insert(0, EAGLE_PATH)
  from eagle import cnets, cnets1
  return cnets, cnets1


cnets, cnets1 = _import_eagle()

VOCAB = 80
GAMMA = 4


# ---------------------------------------------------------------------------
# Targets: ours, exported to transformers (EAGLE's modules read transformers'
# hidden states, as EAGLE's own KV models produce them).

_TARGETS = {}


def _target(layout, layers, dtype="float32"):
  """(our model, transformers' model), float32 weights; cached per (layout, layers)."""
  key = (layout, layers)
  if key not in _TARGETS:
    model = sj.load_model(f"{layout}_tiny", vocab_size=VOCAB, num_layers=layers, seed=layers,
                          dtype="float32")
    # Sharper logits than the random init's, so argmax chains mean something.
    params = dict(model.params)
    if "lm_head" in params:
      params["lm_head"] = jax.tree_util.tree_map(lambda x: x * 8, params["lm_head"])
    else:
      params["embed_tokens"] = jax.tree_util.tree_map(lambda x: x * 12, params["embed_tokens"])
    model = family_of(model).model_type(model.config, params)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
      sj.export_hf(model, d)
      hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    _TARGETS[key] = (model, hf)
  model, hf = _TARGETS[key]
  if dtype != "float32":
    model = family_of(model).model_type(model.config.replace(dtype=dtype),
                        jax.tree_util.tree_map(lambda x: x.astype(dtype), model.params))
  return model, hf


def _features(hf, tokens, kind, layers):
  """Transformers' features of tokens [B, T]: EAGLE-1 the last hidden state after the final
  norm; EAGLE-3 the inputs of its tapped layers, concatenated in EAGLE's order."""
  with torch.no_grad():
    out = hf.model(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True)
  if kind == "eagle1":
    return out.last_hidden_state
  return torch.cat([out.hidden_states[i] for i in _eagle_rule_taps(layers)], dim=-1)


# ---------------------------------------------------------------------------
# Heads built by EAGLE's own modules, written in the public layout.

def _eagle_config(target_config, kind, draft_vocab, qkv_bias, rope=None):
  """The head's config: its own layer settings, unlike the target's (2 heads x 32, not
  4 x 16; intermediate 96, not 128; eps 1e-5; rotary base 10000 by EAGLE's default).
  rope: extra rotary keys (rope_scaling with 'type', rope_theta), as EAGLE reads them."""
  cfg = dict(hidden_size=target_config.emb_dim, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=96, rms_norm_eps=1e-5, max_position_embeddings=2048,
             vocab_size=VOCAB, hidden_act="silu", pad_token_id=0, num_hidden_layers=1,
             pretraining_tp=1, rope_scaling=None)
  if kind == "eagle3":
    cfg["draft_vocab_size"] = draft_vocab
  if qkv_bias:
    cfg["qkv_bias"] = True  # cnets1 builds q/k/v biases iff the config has the attribute
  cfg.update(rope or {})
  return cfg


def _build_eagle_head(case, target, hf):
  """EAGLE's module for a case, random (seeded), its embed_tokens the target's table (as
  EAGLE's load_emb reads it); returns (module, the state dict to write, config.json)."""
  kind = case["kind"]
  draft_ids = case.get("draft_ids")
  draft_vocab = VOCAB if draft_ids is None else len(draft_ids)
  cfg = _eagle_config(target.config, kind, draft_vocab, case.get("qkv_bias", False),
                      case.get("rope"))
  namespace = types.SimpleNamespace(**cfg)
  torch.manual_seed(case["seed"])
  if kind == "eagle1":
    module = cnets1.Model(namespace, bias=case["fc_bias"], total_tokens=GAMMA + 1,
                          depth=GAMMA - 1, top_k=1)
  else:
    module = cnets.Model(namespace, total_tokens=GAMMA + 1, depth=GAMMA - 1, top_k=1)
  gen = torch.Generator().manual_seed(case["seed"] + 1)
  with torch.no_grad():
    for name, param in module.named_parameters():
      if "norm" in name:  # random norms, so a misplaced norm shows
        param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
      elif name.endswith("bias"):
        param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    if kind == "eagle3":
      module.lm_head.weight.mul_(12)
      if draft_ids is not None:
        module.d2t.copy_(torch.tensor(draft_ids - np.arange(draft_vocab)))
        module.t2d.zero_()
        module.t2d[torch.tensor(draft_ids)] = True
    table = torch.tensor(np.asarray(target.params["embed_tokens"]["embedding"], np.float32))
    module.embed_tokens.weight.copy_(table)
  state = dict(module.state_dict())
  if case["embed"] == "own":
    # A table of the head's own, which EAGLE loads over the target's.
    state["embed_tokens.weight"] = table + 0.05 * torch.randn(table.shape, generator=gen)
    with torch.no_grad():
      module.embed_tokens.weight.copy_(state["embed_tokens.weight"])
  elif case["embed"] == "none":
    del state["embed_tokens.weight"]
  if kind == "eagle3" and draft_ids is None:
    del state["d2t"], state["t2d"]  # EaModel deletes them when the vocabularies agree
  config = dict(cfg, architectures=["LlamaForCausalLMEagle3" if kind == "eagle3"
                                    else "LlamaForCausalLM"], model_type="llama",
                torch_dtype="float32")
  if kind == "eagle1":
    config["bias"] = case["fc_bias"]
  config.pop("pretraining_tp")
  if config["rope_scaling"] is None:
    config.pop("rope_scaling")
  module.eval()
  module.init_tree()
  return module, state, config


def _write(directory, state, config, file_format):
  os.makedirs(directory, exist_ok=True)
  state = {k: v.detach().contiguous() for k, v in state.items()}
  if file_format == "bin":
    torch.save(state, os.path.join(directory, "pytorch_model.bin"))
  else:
    from safetensors.torch import save_file
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)


def _draft_ids(size, seed):
  rng = np.random.default_rng(seed)
  return np.sort(rng.choice(VOCAB, size, replace=False)).astype(np.int64)


# Every axis the issue names, each value at least once, on both depths and layouts.
CASES = {
    "eagle1-llama3-bin-bias": dict(kind="eagle1", layout="llama", layers=3, file="bin",
                                   embed="none", fc_bias=True, seed=1),
    "eagle1-llama8-st-ownemb": dict(kind="eagle1", layout="llama", layers=8, file="safetensors",
                                    embed="own", fc_bias=False, seed=2),
    "eagle1-qwen2-3-st-qkv": dict(kind="eagle1", layout="qwen2", layers=3, file="safetensors",
                                  embed="same", fc_bias=True, qkv_bias=True, seed=3),
    "eagle3-llama3-st-d2t": dict(kind="eagle3", layout="llama", layers=3, file="safetensors",
                                 embed="none", draft_ids=_draft_ids(48, 4), seed=4),
    "eagle3-llama8-bin-full-ownemb": dict(kind="eagle3", layout="llama", layers=8, file="bin",
                                          embed="own", seed=5),
    "eagle3-qwen2-8-bin-d2t": dict(kind="eagle3", layout="qwen2", layers=8, file="bin",
                                   embed="same", draft_ids=_draft_ids(40, 6), seed=6),
    # EAGLE's linear rope scaling: positions / factor on base 10000 (its scaled rotary
    # takes no base, so rope_theta is not read).
    "eagle1-llama3-bin-linear-rope": dict(
        kind="eagle1", layout="llama", layers=3, file="bin", embed="none", fc_bias=True,
        seed=7, rope=dict(rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=5e5)),
}
# make test: one case of each kind on each depth; the rest in make test-slow.
FAST = ("eagle1-llama3-bin-bias", "eagle3-llama8-bin-full-ownemb")


def _cases():
  return [pytest.param(name, id=name, marks=() if name in FAST else pytest.mark.slow)
          for name in CASES]


_BUILT = {}


def _case(name, tmp_path_factory):
  """(case, target, hf, EAGLE's module, directory), built once per case."""
  if name not in _BUILT:
    case = CASES[name]
    target, hf = _target(case["layout"], case["layers"])
    module, state, config = _build_eagle_head(case, target, hf)
    directory = str(tmp_path_factory.mktemp(name))
    _write(directory, state, config, case["file"])
    _BUILT[name] = (case, target, hf, module, directory)
  return _BUILT[name]


def _eagle_forward(case, module, hf, tokens, target):
  """EAGLE's `forward` over the pairs (h_t, token_{t+1}) of each row: out [B, T-1, h] and
  its logits over the target vocabulary (EAGLE-1: the target's LM head; EAGLE-3: its own
  lm_head over the draft vocabulary, placed at the target ids d + d2t[d], -inf elsewhere)."""
  features = _features(hf, tokens, case["kind"], case["layers"])
  module.reset()  # no tree mask left from a topK_genrate
  with torch.no_grad():
    out = module(features[:, :-1], input_ids=torch.tensor(tokens[:, 1:], dtype=torch.long))
    if case["kind"] == "eagle1":
      logits = hf.lm_head(out)
    else:
      draft = module.lm_head(module.norm(out))
      ids = (np.arange(VOCAB) if case.get("draft_ids") is None else case["draft_ids"])
      logits = torch.full(draft.shape[:-1] + (VOCAB,), -float("inf"))
      logits[..., torch.tensor(ids)] = draft
  return out.numpy(), logits.numpy()


def _our_forward(draft, tokens, hf, case):
  """Our head over the engine's pairs: (zeros, token_0) at 0, (feature_{t-1}, token_t) at t."""
  head = draft.head
  params, refs = draft.head_params, draft.target_params
  features = jnp.asarray(_features(hf, tokens, case["kind"], case["layers"]).numpy())
  batch, length = tokens.shape
  reduced = head.reduce_features(params, refs, features[:, :-1])
  fed = jnp.concatenate([jnp.zeros((batch, 1, head.hidden_dim)), reduced], axis=1)
  cache = head.init_cache(params, batch, length)
  out, _ = jax.jit(head.apply)(params, refs, jnp.asarray(tokens), fed,
                               jnp.zeros((batch,), jnp.int32), cache)
  logits = jax.jit(head.logits)(params, refs, out)
  return np.asarray(out, np.float32)[:, 1:], np.asarray(logits, np.float32)[:, 1:]


@pytest.mark.parametrize("name", _cases())
def test_loaded_head_logits_equal_eagles_forward(name, tmp_path_factory):
  case, target, hf, module, directory = _case(name, tmp_path_factory)
  draft = sj.load_feature_draft(directory, target)
  # The loader read what EAGLE reads: its own layer settings and embeddings.
  layer = draft.head.layer_config
  assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.mlp_dim,
          layer.norm_epsilon, layer.rope_theta) == (2, 1, 32, 96, 1e-5, 10000.0)
  assert (layer.rope_scaling, layer.rope_factor) == (("linear", 4.0) if "rope" in case else
                                                      (None, layer.rope_factor))
  assert ("embed_tokens" in draft.head_params) == (case["embed"] == "own")
  if case["embed"] != "own":
    assert draft.target_params["embed_tokens"]["embedding"] is (
        target.params["embed_tokens"]["embedding"])  # the target's table, not a copy
  tokens = np.random.default_rng(case["seed"]).integers(0, VOCAB, (2, 12)).astype(np.int32)
  want_out, want_logits = _eagle_forward(case, module, hf, tokens, target)
  got_out, got_logits = _our_forward(draft, tokens, hf, case)
  np.testing.assert_allclose(got_out, want_out, rtol=1e-4, atol=1e-4)
  finite = np.isfinite(want_logits)
  np.testing.assert_array_equal(np.isfinite(got_logits), finite)
  np.testing.assert_allclose(got_logits[finite], want_logits[finite], rtol=1e-4, atol=1e-4)
  assert np.std(want_logits[finite]) > 0.5  # not a degenerate comparison


# ---------------------------------------------------------------------------
# The first proposals and whole decodes.

def _eagle_chain(case, module, hf, prompt):
  """EAGLE's own `topK_genrate` with top_k = 1 after a prompt: its pairs (h_t, token_{t+1})
  for t < n - 1 and the last prompt token as `sample_token`; returns the GAMMA tokens it
  drafts after it."""
  features = _features(hf, prompt[None], case["kind"], case["layers"])
  module.reset_kv()
  with torch.no_grad():
    draft_tokens, *_ = module.topK_genrate(features[:, :-1],
                                           torch.tensor(prompt[None], dtype=torch.long),
                                           hf.lm_head, None)
  drafted = draft_tokens[0, 1:].tolist()
  assert draft_tokens[0, 0] == prompt[-1] and len(drafted) == GAMMA
  return drafted


def _prompts(seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, VOCAB, (4, 9)).astype(np.int32)
  lengths = np.array([9, 2, 6, 1], np.int32)  # a one-token prompt too (no EAGLE pair)
  return tokens, lengths


_GREEDY = dict(max_decode_steps=16, eos_id=-1)


def _decode(target, draft, tokens, lengths):
  from test_eagle_checkpoints import _RecordingDraft  # logs (tokens, laws, limit)
  log = []
  got = sj.generate(target, tokens, lengths, draft=_RecordingDraft(target, draft, log),
                    gamma=GAMMA, **_GREEDY)
  jax.effects_barrier()
  want = sj.generate(target, tokens, lengths, **_GREEDY)
  return np.asarray(got.sequences), np.asarray(want.sequences), got, log


@pytest.mark.parametrize("name", _cases())
def test_first_chain_equals_eagles_topk_genrate_and_greedy_is_exact(name, tmp_path_factory):
  case, target, hf, module, directory = _case(name, tmp_path_factory)
  draft = sj.load_feature_draft(directory, target)
  tokens, lengths = _prompts(case["seed"])
  got, want, result, log = _decode(target, draft, tokens, lengths)
  np.testing.assert_array_equal(got, want)
  assert result.stats.iterations.sum() > 0
  first = log[0][0]
  for b in range(len(lengths)):
    if lengths[b] >= 2:
      chain = _eagle_chain(case, module, hf, tokens[b, :lengths[b]])
      assert first[b].tolist() == chain, (b, first[b], chain)


# ---------------------------------------------------------------------------
# bfloat16.

BF16_CASES = ("eagle1-llama8-st-ownemb", "eagle3-llama8-bin-full-ownemb")


@pytest.mark.parametrize("name", [pytest.param(n, id=n, marks=() if n in FAST else
                                               pytest.mark.slow) for n in BF16_CASES])
def test_bfloat16_head_agrees_where_eagles_margin_exceeds_rounding(name, tmp_path_factory):
  """Our bf16 head (target and head in bf16) against EAGLE's float32 forward: the argmax
  agrees at every position whose float32 top-2 margin exceeds the bf16 error bound
  (16 bf16 ulps of the largest logit there: 16 * 2**-8 * max|logit|), with the count
  reported; and bf16 greedy decoding is the bf16 target's own."""
  case, target32, hf, module, directory = _case(name, tmp_path_factory)
  target, _ = _target(case["layout"], case["layers"], "bfloat16")
  draft = sj.load_feature_draft(directory, target)
  assert draft.head.layer_config.dtype == "bfloat16"
  tokens = np.random.default_rng(case["seed"] + 10).integers(0, VOCAB, (4, 24)).astype(np.int32)
  _, want_logits = _eagle_forward(case, module, hf, tokens, target32)
  _, got_logits = _our_forward(draft, tokens, hf, case)
  top2 = np.sort(np.where(np.isfinite(want_logits), want_logits, -1e9), axis=-1)[..., -2:]
  margin = top2[..., 1] - top2[..., 0]
  bound = 16 * 2.0 ** -8 * np.max(np.abs(np.where(np.isfinite(want_logits), want_logits, 0)),
                                  axis=-1)
  clear = margin > bound
  agree = np.argmax(got_logits, -1) == np.argmax(want_logits, -1)
  finite = np.isfinite(want_logits)
  error = np.max(np.abs(got_logits[finite] - want_logits[finite]))
  print(f"{name}: bf16 argmax equals EAGLE's float32 argmax at {int(agree[clear].sum())} of "
        f"{int(clear.sum())} positions with margin > 16 bf16 ulps ({agree.size} positions, "
        f"{int(agree.sum())} equal overall; largest logit error {error:.3f}, bound at the "
        f"median position {np.median(bound):.3f})")
  assert clear.sum() >= agree.size // 4, "too few clear positions: a degenerate check"
  assert agree[clear].all()
  prompts, lengths = _prompts(case["seed"])
  got, want, result, _ = _decode(target, draft, prompts, lengths)
  np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------
# EAGLE's file precedence.

def test_pytorch_model_bin_wins_over_safetensors_as_in_eagle(tmp_path_factory, tmp_path):
  """EaModel.from_pretrained tries pytorch_model.bin first: a directory holding both
  (here with different weights) is read from the .bin."""
  case, target, hf, module, directory = _case("eagle1-llama3-bin-bias", tmp_path_factory)
  state = torch.load(os.path.join(directory, "pytorch_model.bin"))
  with open(os.path.join(directory, "config.json")) as f:
    config = json.load(f)
  both = str(tmp_path / "both")
  _write(both, state, config, "bin")
  other = {k: v + 1.0 for k, v in state.items()}
  _write(both, other, config, "safetensors")
  flat = jax.tree_util.tree_leaves_with_path(sj.load_feature_draft(both, target).head_params)
  got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}
  fc = [v for k, v in got.items() if "fc" in k and "kernel" in k][0]
  np.testing.assert_array_equal(fc, state["fc.weight"].numpy().T)
