"""Native multi-token-prediction (MTP) modules of decoder-only checkpoints, as feature heads.

Some checkpoints carry their own draft: N modules trained beside the model to
predict one token further than its LM head (DeepSeek-V3 and GLM-4.5's
`num_nextn_predict_layers`, Qwen3-Next / Qwen3.5's `mtp.*`, MiMo's
`model.mtp_layers.*`). Module k at head position t reads a hidden state and
the token there and predicts the token after it:

    e   = token_norm(embedding(x_t))          (zeros at the first pair, DeepSeek and MiMo)
    h   = hidden_norm(feature_{t-1})
    x   = proj([e; h])   (MiMo: proj([h; e]))                          Linear(2h -> h)
    y   = DecoderLayer(x)   (a full layer of the target's own kind: its
                             input norm, attention over the module's own KV
                             cache, its post-attention norm and MLP, MoE where
                             the target's layer N + k would be one)
    DeepSeek:          feeds back y;              logits = shared_head.head(final_norm(y))
    Qwen3-Next, MiMo:  feeds back final_norm(y);  logits = the target's LM head(that)

(vLLM's `deepseek_mtp.py`, `qwen3_next_mtp.py`, `mimo_mtp.py`; docs/mtp.md.)
This is the EAGLE-1 pairing (`families.feature_head`): pair t = (feature_{t-1},
token_t) at absolute position t, its output the state the next pair reads, so
`drafts.FeatureDraft` drives it unchanged and `drafts.MtpDraft` adds the
module order. vLLM numbers the pair (h_p, x_{p+1}) position p, one less than
here: rotary attention sees only differences, and "position 0" there (whose
token embedding DeepSeek and MiMo zero) is absolute position 1 here. The
engine's own pair 0 (zeros, x_0) is hidden from later queries
(`pair_visible`), as vLLM has no such pair.

What hidden state: DeepSeek-V3 and Qwen3-Next read the target's last hidden
state after its final norm (vLLM's `DeepseekV2Model` / `Qwen3NextModel` return
`norm(hidden, residual)`); MiMo reads it before (vLLM's `MiMoModel` returns
`hidden + residual` and norms only in `compute_logits`). The family serves the
normed state (feature layer None); MiMo's pre-norm state h enters only through
hidden_norm(h) = h / sqrt(mean(h^2) + eps) * w_h, and the normed state is
h / sqrt(mean(h^2) + eps) * (o + w_f) (o: the target's norm offset; the same eps),
so `reduce_features` divides the normed feature by (o + w_f) and rescales it to h
(its mean square tells by how much): exact to float rounding (a target whose
final-norm multiplier has a zero entry is refused, that coordinate being lost).

Norm flavours: the module's own norms are x * w (DeepSeek, MiMo) or
Qwen3-Next's zero-centred x * (1 + w) (`Qwen3NextRMSNorm`); the layer's norms are
the target's.

Several modules (N > 1): every module reads every accepted pair (the target's
features), so each has its own context; drafting step i runs module i mod N
(vLLM's module reuse) on the previous step's output and the token it drew, and a
module's query sees the context and the draft keys it wrote itself in this
proposal (`context_end`), never a stale key of another proposal. N = 1 (every
public checkpoint we know) is the plain EAGLE-1 chain, trees included.

Params (`init_params`): {"modules": [one dict per module: token_norm/scale,
hidden_norm/scale, proj/kernel [2 emb, emb], final_norm/scale, head/kernel [emb,
vocab] (DeepSeek), embed_tokens [vocab, emb] (own_embeddings), layer/... (the
target's `layers_{L + k}` tree)]}. Refs: the target's embed_tokens (unless own),
lm_head (untied, without an own head) and norm (MiMo).
"""

import dataclasses
from typing import Hashable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core.token_tree import tree_positions
from specdec_jax.families.decoder_only import network
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig
from specdec_jax.families.decoder_only.network import _MASK_VALUE, Dense, DecoderOnly, Norm
from specdec_jax.families.feature_head import FeatureHead, pair_visible

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MtpLayout:
  """How one checkpoint family's MTP module computes (static).

  hidden_first: proj reads [hidden; embedding] (MiMo) rather than [embedding; hidden].
  zero_first_embedding: the token embedding of vLLM's position 0 (our absolute
    position 1, the pair (h_0, x_1)) is zeroed before its norm (DeepSeek, MiMo).
  norm_offset: the module's own norms multiply by (norm_offset + w): 0, or Qwen3-Next's 1.
  norm_in_logits: final_norm is applied in the logits and the fed-back state is the
    layer's output (DeepSeek's shared_head.norm); else the fed-back state is normed.
  own_head: the module has its own output projection (DeepSeek's shared_head.head).
  reads_pre_norm: the module reads the target's last hidden state before its final
    norm (MiMo); else after.
  """
  name: str
  hidden_first: bool
  zero_first_embedding: bool
  norm_offset: float
  norm_in_logits: bool
  own_head: bool
  reads_pre_norm: bool


LAYOUTS = {
    "deepseek": MtpLayout("deepseek", hidden_first=False, zero_first_embedding=True,
                          norm_offset=0.0, norm_in_logits=True, own_head=True,
                          reads_pre_norm=False),
    "qwen3_next": MtpLayout("qwen3_next", hidden_first=False, zero_first_embedding=False,
                            norm_offset=1.0, norm_in_logits=False, own_head=False,
                            reads_pre_norm=False),
    "mimo": MtpLayout("mimo", hidden_first=True, zero_first_embedding=True, norm_offset=0.0,
                      norm_in_logits=False, own_head=False, reads_pre_norm=True),
}


def layout_named(name) -> MtpLayout:
  if isinstance(name, MtpLayout):
    return name
  if name not in LAYOUTS:
    raise ValueError(f"MTP layout must be one of {tuple(LAYOUTS)}, got {name!r}")
  return LAYOUTS[name]


def extended_config(config: DecoderOnlyConfig, num_modules: int) -> DecoderOnlyConfig:
  """The target's config with num_modules more layers (full attention): module k is its
  layer num_layers + k, a layer of the target's own kind (MoE where the target's rule puts
  one there, as DeepSeek-V3 stores its MTP layer as layer num_hidden_layers)."""
  types = config.layer_types
  return config.replace(
      num_layers=config.num_layers + num_modules,
      layer_types=None if types is None else types + ("full_attention",) * num_modules)


class MtpModule(nn.Module):
  """One module's own arrays: the pre-norms, proj, final_norm, (DeepSeek) head and (own
  embeddings) embed_tokens; its decoder layer is the target's (`MtpHead._layer`)."""
  config: DecoderOnlyConfig  # the target's
  layout: MtpLayout
  own_embeddings: bool = False

  def setup(self):
    cfg = self.config
    own = cfg.replace(norm_offset=self.layout.norm_offset)
    self.token_norm = Norm(own)
    self.hidden_norm = Norm(own)
    self.proj = Dense(cfg.emb_dim, cfg)
    self.final_norm = Norm(own)
    if self.layout.own_head:
      self.head = Dense(cfg.vocab_size, cfg, float32_output=True)
    if self.own_embeddings:
      self.embed_tokens = self.param("embed_tokens", nn.initializers.normal(0.02),
                                     (cfg.vocab_size, cfg.emb_dim), jnp.float32)

  def enter(self, embeddings: Array, hidden: Array) -> Array:
    e = self.token_norm(embeddings)
    h = self.hidden_norm(hidden)
    return self.proj(jnp.concatenate([h, e] if self.layout.hidden_first else [e, h], axis=-1))

  def leave(self, y: Array) -> Array:
    """The state fed back (and read by `logits`)."""
    return y if self.layout.norm_in_logits else self.final_norm(y)

  def logits(self, state: Array) -> Array:
    """DeepSeek: head(final_norm(state)) float32 [..., vocab] (soft-capped as the target's)."""
    logits = self.head(self.final_norm(state))
    cap = self.config.final_logit_softcap
    if cap is not None:
      logits = np.float32(cap) * jnp.tanh(logits / np.float32(cap))
    return logits

  def everything(self, embeddings, hidden):
    """Touches every array (init)."""
    y = self.leave(self.enter(embeddings, hidden))
    out = self.logits(y) if self.layout.own_head else self.final_norm(y)
    if self.own_embeddings:
      out = out.sum() + self.embed_tokens.sum()
    return out


class MtpHead(FeatureHead):
  """A checkpoint's MTP modules as a `FeatureHead` for a decoder-only target.

  Args:
    config: the target's `DecoderOnlyConfig` (rotary, RMSNorm layouts).
    layout: 'deepseek', 'qwen3_next' or 'mimo' (`LAYOUTS`), or an `MtpLayout`.
    num_modules: N, the modules (drafting step i runs module i mod N).
    own_embeddings: each module holds its own token embedding (a DeepSeek checkpoint
      that stores `model.layers.{L + k}.embed_tokens` unlike the target's); else the
      target's table.
  """

  feature_layers = None  # the last hidden state, after the final norm

  def __init__(self, config: DecoderOnlyConfig, layout="deepseek", num_modules: int = 1,
               own_embeddings: bool = False):
    if not isinstance(config, DecoderOnlyConfig):
      raise TypeError(f"MtpHead takes a DecoderOnlyConfig, got {type(config).__name__}")
    if not config.uses_rotary or config.uses_layer_norm:
      raise ValueError(f"MTP modules serve rotary RMSNorm targets; this is a {config.family} "
                       "layout (learned positions, LayerNorm)")
    if not isinstance(num_modules, int) or isinstance(num_modules, bool) or num_modules < 1:
      raise ValueError(f"num_modules must be an int >= 1, got {num_modules!r}")
    self.config = config
    self.layout = layout_named(layout)
    self.num_modules = num_modules
    self.own_embeddings = bool(own_embeddings)
    self.extended = extended_config(config, num_modules)
    self.layer_index = tuple(config.num_layers + k for k in range(num_modules))
    self.moe = tuple(self.extended.moe_layers[j] for j in self.layer_index)

  # -- static -----------------------------------------------------------------

  def static_key(self) -> Hashable:
    return ("decoder_only_mtp", self.config, self.layout, self.num_modules, self.own_embeddings)

  @property
  def module(self) -> MtpModule:
    return MtpModule(self.config, self.layout, self.own_embeddings)

  def _layer(self, k: int):
    """Module k's decoder layer: the target network's own layer num_layers + k (built by
    `DecoderOnly` from the extended config, so it is whatever layer the target's kind has
    there), called as `DecoderOnly._hidden` calls its layers."""
    j = self.layer_index[k]

    def run(model, x, bias, rotary, cache, positions):
      return model.layers[j](x, bias, rotary, cache, positions)

    return DecoderOnly(self.extended), run, f"layers_{j}"

  # -- arrays -----------------------------------------------------------------

  def init_params(self, seed: int = 0):
    """Random modules (normal(0.02) kernels, unit norm multipliers), in the target's dtype
    (one compiled program: eager initialisation dispatches op by op)."""
    return jax.jit(self._init)(jax.random.PRNGKey(seed))

  def _init(self, rng):
    h = self.config.emb_dim
    rngs = jax.random.split(rng, 2 * self.num_modules)
    modules = []
    x = jnp.zeros((1, 1, h), jnp.float32)
    for k in range(self.num_modules):
      own = self.module.init(rngs[2 * k], x, x, method=MtpModule.everything)["params"]
      model, run, name = self._layer(k)
      cache = self._layer_cache(k, 1, 1)
      rotary = network.rotary_tables(jnp.zeros((1, 1), jnp.int32), self.config)
      layer = model.init(rngs[2 * k + 1], x, jnp.zeros((1, 1, 1, 1)), rotary, cache,
                         jnp.zeros((1,), jnp.int32), method=run)["params"][name]
      modules.append(dict(own, layer=layer))
    return jax.tree_util.tree_map(lambda a: a.astype(self.config.dtype), dict(modules=modules))

  def target_refs(self, target_params):
    """The target's embedding table (unless every module has its own, or it is the tied
    output), its LM head (untied, without the modules' own) and (MiMo) its final norm."""
    config, layout = self.config, self.layout
    refs = {}
    if not self.own_embeddings or (config.tie_word_embeddings and not layout.own_head):
      refs["embed_tokens"] = target_params["embed_tokens"]
    if not layout.own_head and not config.tie_word_embeddings:
      refs["lm_head"] = target_params["lm_head"]
    if layout.reads_pre_norm:
      refs["norm"] = target_params["norm"]
      scale = refs["norm"]["scale"]
      if not isinstance(scale, jax.core.Tracer):
        multiplier = config.norm_offset + np.asarray(scale, np.float32)
        if np.any(multiplier == 0):
          raise ValueError(
              f"the target's final norm multiplier is 0 at {np.flatnonzero(multiplier == 0)[:8]}"
              f": the hidden state before the norm, which this {layout.name} MTP module reads, "
              "cannot be recovered from the normed one there")
    return refs

  def reduce_features(self, params, refs, features):
    """Normed target features -> what the modules read: as they are, or (MiMo) the state
    before the final norm, up to a factor per row that the hidden norm removes.

    The normed state is u * (o + w_f) with u = x / sqrt(mean(x^2) + eps); dividing by the
    multiplier gives u, and mean(u^2) = m / (m + eps) (m = mean(x^2)), so c u with c^2 =
    eps / (1 - mean(u^2)) = m + eps is x itself: the hidden norm then sees exactly what it
    would see of x, eps included (which matters when m is not >> eps). 1 - mean(u^2) is
    floored at 1e-12 (it rounds to 0 or below when m >> eps): eps is then nothing against m,
    and any large c gives the same normed state."""
    if not self.layout.reads_pre_norm:
      return features
    multiplier = self.config.norm_offset + refs["norm"]["scale"].astype(jnp.float32)
    u = features.astype(jnp.float32) / multiplier
    gap = jnp.maximum(1.0 - jnp.mean(u * u, axis=-1, keepdims=True), 1e-12)
    return u * jnp.sqrt(np.float32(self.config.norm_epsilon) / gap)

  def _layer_cache(self, k: int, batch: int, max_len: int):
    return network.init_cache(self.extended, batch, max_len)["layers"][self.layer_index[k]]

  def init_cache(self, params, batch: int, max_len: int, memory=None):
    """dict(modules=[module k's layer cache: the target's layer cache layout])."""
    if memory is not None:
      raise ValueError("a decoder-only MTP head reads no memory")
    return dict(modules=[self._layer_cache(k, batch, max_len)
                         for k in range(self.num_modules)])

  # -- computing ----------------------------------------------------------------

  def _embed(self, params, refs, ids, k: int):
    config = self.config
    table = (params["modules"][k]["embed_tokens"] if self.own_embeddings
             else refs["embed_tokens"]["embedding"])
    x = jnp.take(table, ids, axis=0, mode="clip").astype(config.dtype)
    if config.scale_embeddings:
      x = x * jnp.asarray(config.emb_dim ** 0.5, x.dtype)
    return x

  def token_embeddings(self, refs, ids):
    return jnp.take(refs["embed_tokens"]["embedding"], ids, axis=0, mode="clip")

  def _own(self, params, k: int):
    return {name: value for name, value in params["modules"][k].items() if name != "layer"}

  def apply(self, params, refs, tokens, features, positions, cache, tree=None, module=None,
            context_end=None):
    """Scores pairs with module `module` (None: every module, each writing its cache; the
    output is module 0's). context_end [batch]: the absolute position of the proposal's
    last accepted pair (N > 1: module k sees keys past it only where it wrote them itself,
    at context_end + j with j = k mod N); None: causal only."""
    cfg = self.config
    query_at = key_at = allowed = None
    max_len = jax.tree_util.tree_leaves(cache["modules"][0])[0].shape[1]
    if tree is not None:
      query_at, key_at, allowed = tree_positions(tree, positions, max_len)
    else:
      query_at = positions[:, None] + jnp.arange(tokens.shape[1])[None, :]
      key_at = jnp.arange(max_len)[None]
    visible = pair_visible(key_at[:, None, None, :], query_at[:, None, :, None])
    if allowed is not None:
      visible = visible & allowed[:, None]
    rotary = network.rotary_tables(query_at, cfg)
    modules = range(self.num_modules) if module is None else (module,)
    caches = list(cache["modules"])
    first = None
    for k in modules:
      seen = visible
      if context_end is not None and self.num_modules > 1:
        past = key_at[:, None, None, :] - context_end[:, None, None, None]
        seen = seen & ((past <= 0) | (past % self.num_modules == k % self.num_modules))
      bias = jnp.where(seen, 0.0, _MASK_VALUE).astype(jnp.float32)
      embeddings = self._embed(params, refs, tokens, k)
      if self.layout.zero_first_embedding:
        embeddings = jnp.where((query_at == 1)[..., None], jnp.zeros_like(embeddings),
                               embeddings)
      own = self._own(params, k)
      x = self.module.apply({"params": own}, embeddings, features, method=MtpModule.enter)
      model, run, name = self._layer(k)
      y, caches[k] = model.apply({"params": {name: params["modules"][k]["layer"]}}, x, bias,
                                 rotary, caches[k], positions, method=run)
      out = self.module.apply({"params": own}, y, method=MtpModule.leave)
      if first is None:
        first = out
    return first, dict(cache, modules=caches)

  def logits(self, params, refs, hidden, module: int = 0):
    """Module `module`'s law: its own head (DeepSeek) or the target's LM head."""
    if self.layout.own_head:
      return self.module.apply({"params": self._own(params, module)}, hidden,
                               method=MtpModule.logits)
    return DecoderOnly(self.config).apply({"params": refs}, hidden,
                                          method=DecoderOnly.project_logits)
