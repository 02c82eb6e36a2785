"""DFlash (arXiv 2602.06036, z-lab/dflash): a block of masks filled in one non-causal call.

A DFlash drafter is a few transformer layers that read the target's hidden
features. Per row it keeps a context cache, one key and value per layer for
every accepted position, computed from the target's features there:

    c_t          = hidden_norm(fc([f_t at the tapped layers]))        (width h)
    key_t, val_t = k_norm(k_proj(c_t)) rotated at t, v_proj(c_t)      (every layer, one c_t)

To draft, it embeds the block [x_L, m, m, ..., m] (the row's last token, then
K mask tokens) with the target's own token embedding and runs its layers over
it; each layer's queries are the block's, its keys and values are the
context cache's (positions < L) and the block's own (all of them: attention
inside the block is non-causal). The target's own output projection turns
the final states at the K mask slots into the laws q_1..q_K (`drafts.parallel`):

    x  = embed(block) * input_scale
    x += attn(rms(x); keys = [context cache; block]) (+ cross-attention to the
         encoder outputs, for a T5 target) ; x += mlp(rms(x))      (per layer)
    q_i = softmax-adjusted(output_multiplier * lm_head(rms(x)[slot i]))

The layers are Qwen3 layers (q/k RMSNorm per head, rotary positions, SwiGLU),
as z-lab's drafters are for every target; for a T5 target each layer also
cross-attends to the target's encoder outputs (computed once per decode by the
target, `Family.start_features`' memory), a drafter of our own design.

Exactness. The context cache grows only in `observe`, with the target's
features at accepted positions (the engine hands it nothing else) and by the
accepted count: keys a rejected draft would have produced never enter it, so
every law is a function of accepted tokens alone. The block's tokens are drawn
from exactly the laws verification reads (`drafts.parallel`).

Positions. `ctx_len` [batch] is the absolute position of the row's last
token: positions < ctx_len are in the cache. A decoder-only prompt's features
fill it at the start (all but the last prompt token); a T5 decode starts
empty (its decoder has no prompt), and a one-token prompt too: the first
block then attends to itself (and, for T5, to the encoder).

`sj.load_dflash_draft(path, target)` reads z-lab's public checkpoints
(`drafts/dflash_checkpoints.py`).
"""

import dataclasses
import math
from typing import Any, Hashable, Optional, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.drafts.base import target_features
from specdec_jax.drafts.parallel import ParallelDrafter
from specdec_jax.families.registry import family_of

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """The drafter's static shape (hashable: part of the compile key).

  hidden: h, the target's embedding width (embedding and LM head are shared).
  taps: the target's hidden-state indices the context reads (`Family.feature_dim`'s
    layers; z-lab's `target_layer_ids` are taps - 1).
  block_size: z-lab's block (the row's last token and block_size - 1 masks): K =
    block_size - 1 laws per call.
  cross_attention: each layer also attends to the target's encoder outputs (T5).
  """
  hidden: int
  num_layers: int = 1
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 32
  intermediate: int = 256
  taps: Tuple[int, ...] = ()
  block_size: int = 16
  mask_token_id: int = 0
  rms_eps: float = 1e-6
  rope_theta: float = 10000.0
  attention_bias: bool = False
  cross_attention: bool = False
  input_scale: float = 1.0
  output_multiplier: float = 1.0
  final_logit_softcap: Optional[float] = None
  dtype: str = "float32"


def _rms(x: Array, weight: Array, eps: float) -> Array:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * weight.astype(jnp.float32)).astype(x.dtype)


def _rotate(x: Array, positions: Array, theta: float) -> Array:
  """Rotary embedding (the half-split convention of Llama / Qwen3): x [batch, n, heads, d]
  at absolute positions [batch, n]."""
  d = x.shape[-1]
  inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  angles = positions.astype(jnp.float32)[..., None] * inv        # [batch, n, d / 2]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None]
  x32 = x.astype(jnp.float32)
  half = jnp.concatenate([-x32[..., d // 2:], x32[..., :d // 2]], -1)
  return (x32 * cos + half * sin).astype(x.dtype)


def _dense(x: Array, layer: dict, name: str) -> Array:
  y = jnp.einsum("...i,io->...o", x, layer[name]["kernel"].astype(x.dtype),
                 preferred_element_type=jnp.float32)
  if "bias" in layer[name]:
    y = y + layer[name]["bias"].astype(jnp.float32)
  return y.astype(x.dtype)


def _attend(q: Array, k: Array, v: Array, visible: Array, num_kv: int) -> Array:
  """q [b, n, H, d], k / v [b, m, KV, d], visible [b, n, m] -> [b, n, H * d]."""
  b, n, heads, d = q.shape
  groups = heads // num_kv
  q = q.reshape(b, n, num_kv, groups, d)
  scores = jnp.einsum("bnkgd,bmkd->bkgnm", q, k, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(d)
  scores = jnp.where(visible[:, None, None], scores, -1e30)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgnm,bmkd->bnkgd", weights, v, preferred_element_type=jnp.float32)
  return out.reshape(b, n, heads * d).astype(v.dtype)


class DFlashDraft(ParallelDrafter):
  """A DFlash-style block drafter over the target's features (see the module docstring).

  Args:
    target: the target model (any family with `supports_features`).
    block_size: the row's last token plus block_size - 1 masks: K = block_size - 1
      laws per call (DFlash's public drafters: 16).
    num_layers, num_heads, num_kv_heads, head_dim, intermediate: the drafter's layers
      (defaults: the target's heads and head width, 4 x its width for the MLP).
    feature_layers: the target's hidden-state indices read (`Family.feature_dim`'s
      layers); None: DFlash's own choice, `min(5, L)` layers evenly spaced from 1 to
      L - 2 of the target's L (z-lab's `target_layer_ids` plus one), or the last state
      for targets of fewer than 3 layers.
    mask_token_id: the block's mask id (an id of the target's vocabulary).
    seed: random params (normal(0.02) kernels, unit norms).
    params / config: a trained drafter's arrays and shape (`load_dflash_draft`).
  """

  def __init__(self, target, block_size: int = 16, num_layers: int = 1,
               num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
               head_dim: Optional[int] = None, intermediate: Optional[int] = None,
               feature_layers=None, mask_token_id: Optional[int] = None, seed: int = 0,
               params: Optional[Any] = None, config: Optional[DFlashConfig] = None):
    family = family_of(target)
    tc = target.config
    self.target_config = tc
    self.vocab_size = tc.vocab_size
    self.eos_id = tc.eos_id
    self.pad_id = tc.pad_id
    self.continued = family.context(None, None).continued
    if config is None:
      for name, value in (("block_size", block_size), ("num_layers", num_layers)):
        if isinstance(value, bool) or int(value) != value or value < (2 if name == "block_size"
                                                                      else 1):
          raise ValueError(f"{name} must be an int >= {2 if name == 'block_size' else 1}, "
                           f"got {value!r}")
      depth = _depth(tc)
      taps = (tuple(int(i) for i in feature_layers) if feature_layers is not None else
              default_taps(depth))
      mask = tc.vocab_size - 1 if mask_token_id is None else mask_token_id
      heads = num_heads or tc.num_heads
      config = DFlashConfig(
          hidden=tc.emb_dim, num_layers=int(num_layers), num_heads=heads,
          num_kv_heads=num_kv_heads or getattr(tc, "num_kv_heads", heads),
          head_dim=head_dim or tc.head_dim, intermediate=intermediate or 4 * tc.emb_dim,
          taps=taps, block_size=int(block_size), mask_token_id=mask,
          rope_theta=float(getattr(tc, "rope_theta", 10000.0)),
          cross_attention=not self.continued, dtype=str(tc.dtype))
    self.config = config
    self._check_config(config)
    self.reads = target_features(config.taps)
    self.feature_dim = family.feature_dim(tc, config.taps)  # raises for layers it lacks
    # The target's embedding and output projection, through the family's feature-head
    # contract (no family import here).
    self._target_head = family.feature_head(tc)
    self.target_refs = self._target_head.target_refs(target.params)
    self.head_params = self.init_params(seed) if params is None else params
    self._check_params(self.head_params)

  def _check_config(self, config: DFlashConfig) -> None:
    if config.hidden != self.target_config.emb_dim:
      raise ValueError(f"the drafter's hidden size {config.hidden} differs from the target's "
                       f"{self.target_config.emb_dim}: DFlash shares the target's embedding "
                       "and LM head")
    if not 0 <= config.mask_token_id < self.vocab_size:
      raise ValueError(f"mask_token_id {config.mask_token_id} is not an id of the target's "
                       f"vocabulary [0, {self.vocab_size})")
    if config.num_heads % config.num_kv_heads:
      raise ValueError(f"num_heads {config.num_heads} is not a multiple of num_kv_heads "
                       f"{config.num_kv_heads}")
    if config.head_dim % 2:
      raise ValueError(f"head_dim must be even (rotary halves), got {config.head_dim}")
    if config.cross_attention == self.continued:
      raise ValueError("cross_attention must be set exactly for targets with an encoder (T5)")

  # -- arrays ------------------------------------------------------------------

  def param_shapes(self):
    """{name: shape} of the drafter's own arrays (kernels [in, out])."""
    return param_shapes(self.config, self.feature_dim)

  def init_params(self, seed: int = 0):
    """Random arrays: normal(0.02) kernels, zero biases, unit norms, in the target's dtype."""
    flat = {}
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(self.param_shapes())))
    for name, shape in self.param_shapes().items():
      key = next(keys)
      if name.endswith("kernel"):
        flat[name] = 0.02 * jax.random.normal(key, shape)
      elif name.endswith("bias"):
        flat[name] = jnp.zeros(shape)
      else:
        flat[name] = jnp.ones(shape)
    return jax.tree_util.tree_map(lambda x: x.astype(self.config.dtype), unflatten(flat))

  def _check_params(self, params):
    want = self.param_shapes()
    got = {k: tuple(v.shape) for k, v in flatten(params).items()}
    if got != want:
      missing = sorted(set(want) - set(got))
      extra = sorted(set(got) - set(want))
      wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
      raise ValueError(f"DFlash params do not match {self.config}: missing {missing}, "
                       f"unexpected {extra}, wrong shapes "
                       f"{[(k, got[k], want[k]) for k in wrong]}")

  @property
  def params(self) -> Any:
    return dict(draft=self.head_params, target=self.target_refs)

  def static_key(self) -> Hashable:
    return ("dflash", self.target_config, self.config)

  def check_compatible(self, target_config) -> None:
    if target_config != self.target_config:
      raise ValueError("this DFlashDraft was built for another target config: it reads one "
                       "target's features, embedding and output projection")

  @property
  def num_positions(self) -> int:
    return self.config.block_size - 1

  # -- growing with the target (`sj.scale_pair`) -------------------------------------

  def grown_config(self, large_config) -> DFlashConfig:
    """This drafter's shape over a target embedded function-preservingly at large_config:
    the stream r times wider, r times the heads (the same head width, so q/k norms and
    rotations see the same vectors) and MLP units; taps at the same layers, the last state
    (after the final norm) at the large target's last."""
    from specdec_jax.families.widen import EmbeddingError
    c = self.config
    if large_config.emb_dim % c.hidden:
      raise EmbeddingError(f"emb_dim {large_config.emb_dim} is not a multiple of the drafter's "
                           f"{c.hidden}")
    r = large_config.emb_dim // c.hidden
    small_depth = _depth(self.target_config)
    taps = tuple(_depth(large_config) if t == small_depth else t for t in c.taps)
    return dataclasses.replace(c, hidden=c.hidden * r, num_heads=c.num_heads * r,
                               num_kv_heads=c.num_kv_heads * r, intermediate=c.intermediate * r,
                               taps=taps, dtype=str(large_config.dtype))

  def grown_params(self, small_target, large_config):
    """The drafter's arrays over a stream repeated r times (`families.widen`): kernels that
    read the stream keep their rows on each dimension's first copy, kernels that write it
    repeat their outputs, new heads and MLP units are zero (they add nothing), norms repeat.
    The grown drafter computes the same laws over the grown target's features."""
    from specdec_jax.families import widen
    c = self.config
    r = self.grown_config(large_config).hidden // c.hidden
    own = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), self.head_params)
    taps = len(c.taps)
    fc = own["fc"]["kernel"].reshape(taps, c.hidden, c.hidden)
    out = dict(fc=dict(kernel=widen.repeat(widen.first_copy(fc, 1, r), 2, r).reshape(
                   taps * c.hidden * r, c.hidden * r)),
               hidden_norm=widen.repeat(own["hidden_norm"], 0, r),
               norm=widen.repeat(own["norm"], 0, r), layers={})

    def heads(x, axis, kv=False):
      n = c.num_kv_heads if kv else c.num_heads
      return widen.pad_heads(x, axis, n, c.head_dim, n * r, c.head_dim)

    def attention(a):
      grown = {name: dict(kernel=heads(widen.first_copy(a[name]["kernel"], 0, r), 1,
                                       kv=name != "q_proj"))
               for name in ("q_proj", "k_proj", "v_proj")}
      grown["o_proj"] = dict(kernel=widen.repeat(heads(a["o_proj"]["kernel"], 0), 1, r))
      if c.attention_bias:
        for name in ("q_proj", "k_proj", "v_proj"):
          grown[name]["bias"] = heads(a[name]["bias"], 0, kv=name != "q_proj")
        grown["o_proj"]["bias"] = widen.repeat(a["o_proj"]["bias"], 0, r)
      grown["q_norm"], grown["k_norm"] = a["q_norm"], a["k_norm"]
      return grown

    units = c.intermediate * r
    for i, layer in own["layers"].items():
      mlp = layer["mlp"]
      grown = dict(
          self_attn=attention(layer["self_attn"]),
          input_layernorm=widen.repeat(layer["input_layernorm"], 0, r),
          post_attention_layernorm=widen.repeat(layer["post_attention_layernorm"], 0, r),
          mlp=dict(gate_proj=dict(kernel=widen.pad(widen.first_copy(
                       mlp["gate_proj"]["kernel"], 0, r), 1, units)),
                   up_proj=dict(kernel=widen.pad(widen.first_copy(
                       mlp["up_proj"]["kernel"], 0, r), 1, units)),
                   down_proj=dict(kernel=widen.repeat(widen.pad(
                       mlp["down_proj"]["kernel"], 0, units), 1, r))))
      if c.cross_attention:
        grown["cross_attn"] = attention(layer["cross_attn"])
        grown["cross_layernorm"] = widen.repeat(layer["cross_layernorm"], 0, r)
      out["layers"][i] = grown
    return out

  def with_grown_params(self, large_target, params) -> "DFlashDraft":
    config = self.grown_config(large_target.config)
    if getattr(large_target.config, "kernel_layout", "in_out") != "in_out":
      # The protocol hands the arrays in the large target's kernel layout (`sj.scale_pair`:
      # out_in); the drafter's own kernels are always [in, out].
      from specdec_jax.families import kernel_layout as layouts
      params = layouts.transpose_kernels(params)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, config.dtype), params)
    return DFlashDraft(large_target, config=config, params=params)

  # -- the network ---------------------------------------------------------------

  def context(self, own, features: Array) -> Array:
    """The target's features [batch, n, f] -> the context stream c [batch, n, h]."""
    x = jnp.einsum("bnf,fh->bnh", features.astype(self.config.dtype),
                   own["fc"]["kernel"].astype(self.config.dtype),
                   preferred_element_type=jnp.float32).astype(self.config.dtype)
    return _rms(x, own["hidden_norm"], self.config.rms_eps)

  def _key_value(self, attn, x: Array, positions: Array):
    c = self.config
    b, n, _ = x.shape
    k = _dense(x, attn, "k_proj").reshape(b, n, c.num_kv_heads, c.head_dim)
    v = _dense(x, attn, "v_proj").reshape(b, n, c.num_kv_heads, c.head_dim)
    k = _rotate(_rms(k, attn["k_norm"], c.rms_eps), positions, c.rope_theta)
    return k, v

  def context_key_values(self, own, features: Array, positions: Array):
    """Per layer (keys, values) [layers, batch, n, kv_heads, d] of features [batch, n, f]
    at absolute positions [batch, n]: what the context cache holds."""
    ctx = self.context(own, features)
    pairs = [self._key_value(own["layers"][str(i)]["self_attn"], ctx, positions)
             for i in range(self.config.num_layers)]
    return jnp.stack([k for k, _ in pairs]), jnp.stack([v for _, v in pairs])

  def cross_key_values(self, own, encoded: Array):
    """(keys, values) [layers, batch, S, kv_heads, d] of the encoder outputs (no rotation)."""
    c = self.config
    b, s, _ = encoded.shape
    keys, values = [], []
    for i in range(c.num_layers):
      attn = own["layers"][str(i)]["cross_attn"]
      x = encoded.astype(c.dtype)
      k = _rms(_dense(x, attn, "k_proj").reshape(b, s, c.num_kv_heads, c.head_dim),
               attn["k_norm"], c.rms_eps)
      keys.append(k)
      values.append(_dense(x, attn, "v_proj").reshape(b, s, c.num_kv_heads, c.head_dim))
    return jnp.stack(keys), jnp.stack(values)

  def block_hidden(self, params, tokens: Array, positions: Array, ctx_keys: Array,
                   ctx_values: Array, ctx_visible: Array, cross=None) -> Array:
    """The drafter over a block: tokens [batch, n] at absolute positions [batch, n], the
    context cache (ctx_keys / ctx_values [layers, batch, m, kv, d], ctx_visible
    [batch, m] bool) and, for T5, cross = (keys, values [layers, batch, S, kv, d],
    encoder_mask [batch, S]). Returns the final states [batch, n, h] (non-causal)."""
    c, own = self.config, params["draft"]
    b, n = tokens.shape
    x = self._target_head.token_embeddings(params["target"], tokens).astype(c.dtype)
    if c.input_scale != 1.0:
      x = x * jnp.asarray(c.input_scale, x.dtype)
    visible = jnp.concatenate([jnp.broadcast_to(ctx_visible[:, None], (b, n) + ctx_visible.shape[1:]),
                               jnp.ones((b, n, n), bool)], axis=2)
    for i in range(c.num_layers):
      layer = own["layers"][str(i)]
      attn = layer["self_attn"]
      y = _rms(x, layer["input_layernorm"], c.rms_eps)
      q = _dense(y, attn, "q_proj").reshape(b, n, c.num_heads, c.head_dim)
      q = _rotate(_rms(q, attn["q_norm"], c.rms_eps), positions, c.rope_theta)
      k, v = self._key_value(attn, y, positions)
      k = jnp.concatenate([ctx_keys[i].astype(k.dtype), k], axis=1)
      v = jnp.concatenate([ctx_values[i].astype(v.dtype), v], axis=1)
      x = x + _dense(_attend(q, k, v, visible, c.num_kv_heads), attn, "o_proj")
      if c.cross_attention:
        cross_keys, cross_values, encoder_mask = cross
        attn = layer["cross_attn"]
        y = _rms(x, layer["cross_layernorm"], c.rms_eps)
        q = _rms(_dense(y, attn, "q_proj").reshape(b, n, c.num_heads, c.head_dim),
                 attn["q_norm"], c.rms_eps)
        seen = jnp.broadcast_to(encoder_mask[:, None].astype(bool),
                                (b, n, encoder_mask.shape[1]))
        x = x + _dense(_attend(q, cross_keys[i].astype(q.dtype), cross_values[i].astype(q.dtype),
                               seen, c.num_kv_heads), attn, "o_proj")
      y = _rms(x, layer["post_attention_layernorm"], c.rms_eps)
      mlp = layer["mlp"]
      gated = jax.nn.silu(_dense(y, mlp, "gate_proj").astype(jnp.float32)) * _dense(
          y, mlp, "up_proj").astype(jnp.float32)
      x = x + _dense(gated.astype(c.dtype), mlp, "down_proj")
    return _rms(x, own["norm"], c.rms_eps)

  def logits(self, params, hidden: Array) -> Array:
    """The target's output projection of the drafter's states -> logits float32."""
    c = self.config
    logits = self._target_head.logits(None, params["target"], hidden).astype(jnp.float32)
    if c.output_multiplier != 1.0:
      logits = logits * c.output_multiplier
    if c.final_logit_softcap:
      logits = jnp.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
    return logits

  # -- the decode loop --------------------------------------------------------------

  def init_state(self, params, start):
    """dict(keys / values [layers, batch, max_len, kv, d]: the context cache by absolute
    position; ctx_len [batch]: positions < ctx_len hold accepted tokens' features, and
    the row's last token sits at ctx_len; offset [batch]: loop position 0's absolute
    position; cross: T5's encoder keys / values and mask, or absent)."""
    c, own = self.config, params["draft"]
    context = start.context
    batch = context.tokens.shape[0]
    max_len = start.max_decode_len + (context.tokens.shape[1] if self.continued else 0) + 1
    shape = (c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)
    keys, values = jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype)
    lengths = context.lengths.astype(jnp.int32)
    offset = lengths - 1 if self.continued else jnp.zeros((batch,), jnp.int32)
    features = start.features
    if self.continued and features is not None and features.shape[1] > 0:
      width = features.shape[1]
      positions = jnp.broadcast_to(jnp.arange(width)[None], (batch, width))
      new_keys, new_values = self.context_key_values(own, features, positions)
      keys = keys.at[:, :, :width].set(new_keys)
      values = values.at[:, :, :width].set(new_values)
    state = dict(keys=keys, values=values, ctx_len=offset, offset=offset)
    if c.cross_attention:
      memory = start.memory
      if memory is None:  # shape queries
        memory = self._target_head.placeholder_memory(batch, context.tokens.shape[1])
      cross_keys, cross_values = self.cross_key_values(own, memory["encoded"])
      state["cross"] = dict(keys=cross_keys, values=cross_values,
                            mask=memory["encoder_mask"].astype(bool))
    return state

  def observer(self, params):
    def observe(state, features, tokens, count):
      """The target's features at the accepted block positions 0..count-1 enter the
      cache at ctx_len..ctx_len+count-1; ctx_len advances by count (slots past count,
      zeros, are written but stay beyond ctx_len, and are overwritten later)."""
      del tokens
      batch, n = features.shape[:2]
      positions = state["ctx_len"][:, None] + jnp.arange(n)[None]
      new_keys, new_values = self.context_key_values(params["draft"], features, positions)
      rows = jnp.arange(batch)[:, None]
      keys = state["keys"].at[:, rows, positions].set(new_keys, mode="drop")
      values = state["values"].at[:, rows, positions].set(new_values, mode="drop")
      return dict(state, keys=keys, values=values, ctx_len=state["ctx_len"] + count)
    return observe

  def block_laws(self, params, state, sequences, lengths, num, window):
    del window  # the context grows in `observe`, never from the block
    batch = sequences.shape[0]
    rows = jnp.arange(batch)
    last = sequences[rows, lengths]
    tokens = jnp.concatenate([last[:, None], jnp.full((batch, num), self.config.mask_token_id,
                                                      jnp.int32)], axis=1)
    positions = state["ctx_len"][:, None] + jnp.arange(num + 1)[None]
    max_len = state["keys"].shape[2]
    ctx_visible = jnp.arange(max_len)[None] < state["ctx_len"][:, None]
    cross = None
    if self.config.cross_attention:
      cross = (state["cross"]["keys"], state["cross"]["values"], state["cross"]["mask"])
    hidden = self.block_hidden(params, tokens, positions, state["keys"], state["values"],
                               ctx_visible, cross)
    return self.logits(params, hidden[:, 1:]), jnp.ones((batch,), jnp.bool_), state


def param_shapes(c: DFlashConfig, feature_dim: int) -> dict:
  """{flat name: shape} of a drafter of config c over target features of width feature_dim
  (kernels [in, out])."""
  h, q, kv = c.hidden, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

  def attention(prefix):
    kernels = dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h))
    shapes = {f"{prefix}/{n}/kernel": s for n, s in kernels.items()}
    shapes.update({f"{prefix}/q_norm": (c.head_dim,), f"{prefix}/k_norm": (c.head_dim,)})
    if c.attention_bias:
      shapes.update({f"{prefix}/{n}/bias": (s[1],) for n, s in kernels.items()})
    return shapes

  shapes = {"fc/kernel": (feature_dim, h), "hidden_norm": (h,), "norm": (h,)}
  for i in range(c.num_layers):
    p = f"layers/{i}"
    shapes.update(attention(f"{p}/self_attn"))
    shapes.update({f"{p}/input_layernorm": (h,), f"{p}/post_attention_layernorm": (h,),
                   f"{p}/mlp/gate_proj/kernel": (h, c.intermediate),
                   f"{p}/mlp/up_proj/kernel": (h, c.intermediate),
                   f"{p}/mlp/down_proj/kernel": (c.intermediate, h)})
    if c.cross_attention:
      shapes.update(attention(f"{p}/cross_attn"))
      shapes[f"{p}/cross_layernorm"] = (h,)
  return shapes


def _depth(target_config) -> int:
  """The target's (decoder) layer count."""
  return getattr(target_config, "num_layers", None) or target_config.num_decoder_layers


def default_taps(num_layers: int) -> Tuple[int, ...]:
  """DFlash's feature layers for a target of `num_layers` layers, as hidden-state indices:
  min(5, L - 2) layers evenly spaced over 1..L - 2 (z-lab's `target_layer_ids`, + 1), or
  the last state for targets of fewer than 3 layers."""
  if num_layers < 3:
    return (num_layers,)
  count = min(5, num_layers - 2)
  ids = sorted({int(round(1 + i * (num_layers - 3) / max(count - 1, 1))) for i in range(count)})
  return tuple(i + 1 for i in ids)


def flatten(tree, prefix: str = "") -> dict:
  """Nested dicts -> {'a/b/c': leaf}."""
  out = {}
  for key, value in dict(tree).items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten(value, name + "/"))
    else:
      out[name] = value
  return out


def unflatten(flat: dict) -> dict:
  """{'a/b/c': leaf} -> nested dicts."""
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = name.split("/")
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return tree
