"""The EAGLE-3 feature head (arXiv 2503.01840) for decoder-only (Llama-layout, rotary) targets.

What it computes (the public EAGLE-3 code, SafeAILab/EAGLE `eagle/model/cnets.py`
`Model` / `LlamaDecoderLayeremb`, and vLLM's `llama_eagle3.py` agree):

    g_t  = fc(feature)                 Linear(3H -> h, no bias), when the fed
                                       feature is the target's (3H wide)
    g_t  = feature                     when it is the head's own output (h wide)
    a    = [input_layernorm(embed(token_t)); hidden_norm(g_t)]          [2h]
    x    = g_t + o_proj(attention(q/k/v_proj(a)))    q/k/v: Linear(2h -> ...)
    out  = x + mlp(post_attention_layernorm(x))      SwiGLU, h -> mlp -> h
    p(token_{t+1}) over the draft vocabulary = softmax(lm_head(norm(out)))

* The target's features are the inputs of its layers 2, L // 2 and L - 3,
  concatenated in ascending layer order, as the EAGLE-3 code takes them (it
  appends `hidden_states` before decoder layer idx when idx is one of them,
  i.e. HF `hidden_states[idx]`); vLLM's aux hidden states (`hidden_states +
  residual` at the same layer inputs) are the same vectors. That is
  `families.feature_head.eagle3_taps`: (2, L // 2, L - 3) for L >= 7, (0, 1,
  2) for L = 3, and an error for the depths where EAGLE defines no three
  distinct taps (L = 4..6 and L < 3).
* Multi-step drafting feeds back `out` itself, before the final norm (cnets.py
  `topK_genrate`: `input_hidden = out_hidden[...]`; it is h wide, so `forward`
  skips fc: `if hidden_states.shape[-1] != inputs_embeds.shape[-1]`). Here
  fc is the head's `reduce_features` (the feature-head contract: target
  features are reduced once, when they arrive), so `apply` reads h-wide
  features either way and the draft loop needs no EAGLE-3 case. The zero
  feature of the first pair is zero either way (fc has no bias).
* Reduced vocabulary: `lm_head` maps to draft_vocab_size ids; draft id d is
  target id d + d2t[d]. `logits` returns target-vocabulary logits with -inf at
  every target id outside the draft vocabulary (`t2d` false there): the draft's
  law q is zero there, so the engine's verification (which only needs q's
  values at the drafted ids, drawn from q) stays exact and nothing outside the
  draft vocabulary is ever drafted.
* Positions. The engine feeds pair (feature_{t-1}, token_t) at absolute
  position t, with a zero feature at t = 0 (`drafts.feature_draft`); queries past
  position 0 do not see it (`families.feature_head.pair_visible`), so a loaded
  public head sees what it was trained on.
* Embeddings: the target's table, looked up raw (EAGLE's `nn.Embedding`; no
  Gemma scale), or the head's own `embed_tokens` when its checkpoint carries
  one (some exporters save a frozen copy).

Param tree (kernels [in, out]; HF Linear weights are their transpose):
  fc/kernel                                        [3H, h]
  midlayer/{hidden_norm,input_layernorm,post_attention_layernorm}/scale [h]
  midlayer/self_attn/{q,k,v}_proj/kernel           [2h, heads|kv_heads * head_dim]
  midlayer/self_attn/o_proj/kernel                 [heads * head_dim, h]
  midlayer/mlp/{gate,up}_proj/kernel               [h, mlp]
  midlayer/mlp/down_proj/kernel                    [mlp, h]
  norm/scale                                       [h]
  lm_head/kernel                                   [h, draft_vocab]
  embed_tokens (optional)                          [vocab, h]
The draft-to-target id map is not a param (nothing trains it, and a cast of
the tree to bfloat16 must not touch it): it is the head's `draft_to_target`
[draft_vocab] int32, part of its static key.
"""

import hashlib
from typing import Hashable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core.token_tree import tree_positions
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.model import feature_layers
from specdec_jax.families.decoder_only.network import (_MASK_VALUE, Attention, Dense, Mlp, Norm,
                                                       rotary_tables)
from specdec_jax.families.feature_head import FeatureHead, pair_visible

Array = jax.Array

# Target layouts whose features and embeddings mean what an EAGLE-3 head (a
# Llama layer over raw embeddings) was trained on.
SUPPORTED_TARGET_FAMILIES = ("llama", "qwen2", "mistral")


def check_rotary_target(target_config, what: str = "an EAGLE-3 head",
                        error: type = ValueError) -> None:
  """Raises `error` unless the target is a decoder-only Llama-layout rotary model.

  EAGLE heads (EAGLE-1 and -3 checkpoints, `Eagle3Head`) are Llama layers
  whose rotary attention reads the target's positions; a T5 or GPT-2 target
  has neither. One check, so a constructor and a checkpoint loader word it alike.
  """
  if not isinstance(target_config, DecoderOnlyConfig):
    raise error(f"{what} drafts for decoder-only Llama-layout targets; the target is "
                f"a {type(target_config).__name__} model")
  if target_config.family not in SUPPORTED_TARGET_FAMILIES:
    raise error(f"{what} drafts for Llama-layout rotary targets "
                f"({', '.join(SUPPORTED_TARGET_FAMILIES)}); a {target_config.family} "
                f"target layout is not supported")


class Eagle3Midlayer(nn.Module):
  """The EAGLE-3 decoder layer: attention over [input_layernorm(emb); hidden_norm(g)].

  Its q/k/v projections read 2h (Dense infers the input width); the residual
  is g itself (EAGLE-3's `residual = hidden_states` before `hidden_norm`).
  """
  config: DecoderOnlyConfig

  def setup(self):
    cfg = self.config
    self.hidden_norm = Norm(cfg)
    self.input_layernorm = Norm(cfg)
    self.self_attn = Attention(cfg)
    self.post_attention_layernorm = Norm(cfg)
    self.mlp = Mlp(cfg)

  def __call__(self, embeddings, hidden, bias, rotary, layer_cache, positions):
    """embeddings, hidden [batch, k, h] -> ([batch, k, h] in config.dtype, layer cache)."""
    dtype = jnp.dtype(self.config.dtype)
    hidden = hidden.astype(dtype)
    attention_in = jnp.concatenate([self.input_layernorm(embeddings.astype(dtype)),
                                    self.hidden_norm(hidden)], axis=-1)
    attended, new_cache = self.self_attn(attention_in, bias, rotary, layer_cache, positions)
    x = hidden + attended
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, new_cache


class Eagle3Network(nn.Module):
  """fc (for target features), the midlayer, and the final norm + draft-vocabulary lm_head."""
  config: DecoderOnlyConfig
  draft_vocab_size: int
  own_embeddings: bool = False

  def setup(self):
    cfg = self.config
    self.fc = Dense(cfg.emb_dim, cfg)
    self.midlayer = Eagle3Midlayer(cfg)
    self.norm = Norm(cfg)
    self.lm_head = Dense(self.draft_vocab_size, cfg, float32_output=True)
    if self.own_embeddings:
      self.embed_tokens = self.param("embed_tokens", nn.initializers.normal(0.02),
                                     (cfg.vocab_size, cfg.emb_dim), jnp.float32)

  def __call__(self, embeddings, hidden, positions, cache, tree=None):
    """One block of pairs through the midlayer.

    Args:
      embeddings: [batch, k, h] the tokens' embeddings.
      hidden: [batch, k, h] fc's output of target features (`reduce`), or the
        head's own previous outputs (fed as they are, EAGLE-3's choice).
      positions: [batch] int32, the cache index of each row's first pair (without
        a tree also its absolute position).
      cache: dict(self_key, self_value) [batch, max_len, kv_heads, head_dim].
      tree: None, or a `core.token_tree.TreeAttention` block (`FeatureHead.apply`).
    Returns:
      (out [batch, k, h] before the final norm, cache).
    """
    cfg = self.config
    max_len = cache["self_key"].shape[1]
    if tree is None:
      query_at = positions[:, None] + jnp.arange(embeddings.shape[1])[None, :]
      key_at = jnp.arange(max_len)[None, None, None, :]
      allowed = True
    else:
      query_at, key_positions, allowed = tree_positions(tree, positions, max_len)
      key_at, allowed = key_positions[:, None, None, :], allowed[:, None]
    # Causal, the zero first pair hidden (`pair_visible`: EAGLE has no such pair).
    visible = pair_visible(key_at, query_at[:, None, :, None]) & allowed
    bias = jnp.where(visible, 0.0, _MASK_VALUE).astype(jnp.float32)
    rotary = rotary_tables(query_at, cfg)
    return self.midlayer(embeddings, hidden, bias, rotary, cache, positions)

  def reduce(self, features):
    """Target features [..., 3H] -> fc's output [..., h] (no bias: zeros stay zeros)."""
    return self.fc(features)

  def draft_logits(self, out):
    """out [..., h] -> draft-vocabulary logits [..., draft_vocab] float32."""
    return self.lm_head(self.norm(out))

  def init_all(self, embeddings, features, positions, cache):
    """Touches every submodule (for `init`): fc, the midlayer, the output head."""
    out, _ = self(embeddings, self.reduce(features), positions, cache)
    return self.draft_logits(out)


def check_draft_to_target(draft_to_target, vocab_size: int, origin: str = "d2t") -> np.ndarray:
  """The draft-to-target id map as int32 [draft_vocab], validated: ids in [0, vocab), distinct."""
  ids = np.asarray(draft_to_target)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{origin}: the draft-to-target map must be a non-empty 1-D integer array, "
                     f"got shape {ids.shape} dtype {ids.dtype}")
  outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
  if outside.size:
    raise ValueError(f"{origin}: draft ids {outside[:8].tolist()} map to target ids "
                     f"{ids[outside[:8]].tolist()}, outside the target vocabulary [0, "
                     f"{vocab_size})")
  unique, counts = np.unique(ids, return_counts=True)
  if (counts > 1).any():
    raise ValueError(f"{origin}: several draft ids map to target ids "
                     f"{unique[counts > 1][:8].tolist()}; the map must be one-to-one")
  return ids.astype(np.int32)


def head_config_like(target_config: DecoderOnlyConfig) -> DecoderOnlyConfig:
  """A one-layer Llama config of the target's shapes and rotary (no biases, full attention)."""
  return target_config.replace(family="llama", num_layers=1, layer_types=None,
                               sliding_window=None, qkv_bias=False, out_bias=False,
                               mlp_bias=False, activation="silu")


class Eagle3Head(FeatureHead):
  """An EAGLE-3 head for a decoder-only target (the family's `FeatureHead` contract).

  Args:
    target_config: the target's `DecoderOnlyConfig` (a Llama / Qwen2 / Mistral
      layout): its features (`feature_layers(.., "eagle3")`), vocabulary and
      embedding table are the head's inputs. The head's `config`.
    layer_config: the head's own layer (emb_dim = the target's; heads, mlp
      width, rotary settings and dtype may differ, as a checkpoint's
      config.json says); None: `head_config_like(target_config)`.
    draft_to_target: [draft_vocab] target ids of the draft vocabulary (EAGLE's
      arange + d2t); None: the whole target vocabulary, in order.
    own_embeddings: the head holds its own `embed_tokens` [vocab, h] instead of
      reading the target's.
  """

  kind = "eagle3"
  feature_layers = "eagle3"

  def __init__(self, target_config: DecoderOnlyConfig,
               layer_config: Optional[DecoderOnlyConfig] = None, draft_to_target=None,
               own_embeddings: bool = False):
    check_rotary_target(target_config)
    self.config = target_config
    if layer_config is None:
      layer_config = head_config_like(target_config)
    if layer_config.emb_dim != target_config.emb_dim:
      raise ValueError(f"the head's hidden size {layer_config.emb_dim} differs from the "
                       f"target's emb_dim {target_config.emb_dim}")
    if (layer_config.family != "llama" or layer_config.qkv_bias or layer_config.out_bias or
        layer_config.mlp_bias or layer_config.activation != "silu"):
      raise ValueError("an EAGLE-3 head's layer is a Llama layer (no biases, SiLU); got "
                       f"family={layer_config.family} qkv_bias={layer_config.qkv_bias} "
                       f"out_bias={layer_config.out_bias} mlp_bias={layer_config.mlp_bias} "
                       f"activation={layer_config.activation}")
    self.layer_config = layer_config.replace(vocab_size=target_config.vocab_size, num_layers=1,
                                             layer_types=None, sliding_window=None)
    if draft_to_target is None:
      draft_to_target = np.arange(target_config.vocab_size)
    self.draft_to_target = check_draft_to_target(draft_to_target, target_config.vocab_size)
    self.draft_vocab_size = int(self.draft_to_target.size)
    # [vocab] int32: each target id's draft id (0 where it has none; masked in `logits`).
    self.target_to_draft = np.zeros(target_config.vocab_size, np.int32)
    self.target_to_draft[self.draft_to_target] = np.arange(self.draft_vocab_size)
    self.own_embeddings = bool(own_embeddings)
    self.taps = feature_layers(target_config, "eagle3")
    self._map_digest = hashlib.sha1(self.draft_to_target.tobytes()).hexdigest()

  @property
  def feature_dim(self) -> int:
    """3H: the width of the target features the head reads."""
    return len(self.taps) * self.config.emb_dim

  def in_draft_vocab(self) -> np.ndarray:
    """[vocab] bool: the target ids the head can draft (EAGLE's `t2d`)."""
    mask = np.zeros(self.vocab_size, bool)
    mask[self.draft_to_target] = True
    return mask

  @property
  def network(self) -> Eagle3Network:
    return Eagle3Network(self.layer_config, self.draft_vocab_size, self.own_embeddings)

  def static_key(self) -> Hashable:
    return ("eagle3", self.layer_config, self.config, self.own_embeddings, self._map_digest)

  def init_params(self, seed: int = 0):
    """Random params (normal(0.02) kernels, unit norms) in the layer config's dtype."""
    h = self.hidden_dim
    params = self.network.init(
        jax.random.PRNGKey(seed), jnp.zeros((1, 1, h)), jnp.zeros((1, 1, self.feature_dim)),
        jnp.zeros((1,), jnp.int32), self.init_cache(None, 1, 1),
        method=Eagle3Network.init_all)["params"]
    return jax.tree_util.tree_map(lambda x: x.astype(self.layer_config.dtype), params)

  def target_refs(self, target_params):
    """The target's arrays the head reads: its embedding table (a reference, not a copy)."""
    if self.own_embeddings:
      return {}
    return {"embed_tokens": target_params["embed_tokens"]}

  def reduce_features(self, params, refs, features: Array) -> Array:
    """Target features [..., 3H] -> fc's output [..., h] float32."""
    del refs
    return self.network.apply({"params": params}, features,
                              method=Eagle3Network.reduce).astype(jnp.float32)

  def init_cache(self, params, batch: int, max_len: int, memory=None):
    """dict(self_key, self_value) [batch, max_len, kv_heads, head_dim]; no memory."""
    del params
    if memory is not None:
      raise ValueError("a decoder-only feature head reads no memory")
    cfg = self.layer_config
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return dict(self_key=jnp.zeros(shape, cfg.dtype), self_value=jnp.zeros(shape, cfg.dtype))

  def embed(self, params, refs, tokens: Array) -> Array:
    """tokens [batch, k] -> embeddings [batch, k, h] (raw table rows, EAGLE's nn.Embedding)."""
    table = (params["embed_tokens"] if self.own_embeddings else
             refs["embed_tokens"]["embedding"])
    return jnp.take(table, tokens, axis=0, mode="clip").astype(self.layer_config.dtype)

  def apply(self, params, refs, tokens: Array, features: Array, positions: Array, cache,
            tree=None):
    """Pairs (features[:, i], tokens[:, i]) at absolute positions positions[b] + i (or a
    tree's, `FeatureHead.apply`).

    tokens [batch, k] int32; features [batch, k, h]: reduced target features
    or the head's own outputs; positions [batch]. Returns (out [batch, k, h]
    before the final norm, the feature fed back; cache).
    """
    return self.network.apply({"params": params}, self.embed(params, refs, tokens), features,
                              positions, cache, tree)

  def draft_logits(self, params, hidden: Array) -> Array:
    """hidden [..., h] -> logits over the draft vocabulary [..., draft_vocab] float32."""
    return self.network.apply({"params": params}, hidden, method=Eagle3Network.draft_logits)

  def logits(self, params, refs, hidden: Array) -> Array:
    """hidden [..., h] -> target-vocabulary logits [..., vocab] float32, -inf outside
    the draft vocabulary."""
    del refs
    draft = self.draft_logits(params, hidden)
    # A gather from the draft logits, not a scatter into -inf's: with the
    # scatter, XLA CPU left the bf16 x bf16 -> f32 lm_head dot to a DotThunk
    # that does not implement it ("Unsupported element type for
    # DotThunk::Execute: BF16 x BF16 = F32", bf16 decodes at batch 6).
    full = jnp.take(draft, jnp.asarray(self.target_to_draft), axis=-1)
    return jnp.where(jnp.asarray(self.in_draft_vocab()), full, -jnp.inf)
