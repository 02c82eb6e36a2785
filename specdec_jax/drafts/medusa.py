"""Medusa heads (Cai et al., arXiv 2401.10774): K heads on the target's last hidden state.

Head k (1-based) reads h_t, the target's hidden state after its final norm at
position t (the state that produced token t+1's distribution), and predicts
token t+1+k:

    x_k   = x_{k,j-1} + SiLU(W_{k,j} x_{k,j-1} + b_{k,j})    j = 1..num_layers, x_{k,0} = h_t
    q_k   = softmax(lm_head_k(x_k))    lm_head_k: the head's own Linear(h -> vocab),
                                       or the target's own output projection
                                       (share_lm_head: one table, no copy)

So after a verification whose new token sits at position t + 1, the heads
on h_t draft positions t+2..t+1+gamma, all in **one call** (the K heads are
one batched matmul per layer): no draft-side recurrence, no draft cache.

Exact: the engine verifies with each head's own adjusted law q_k (the same
temperature / top-k / top-p as the target), never Medusa's lossy "typical
acceptance"; a drafted token depends only on h_t and fresh randomness, and
h_t is the target's feature at an accepted position (the loop hands the
draft nothing from a rejected draft), so outputs are the target's exactly.

Positions. The state holds h at the position before the row's last token
(the draft's `observe` receives the target's features at the kept
block positions; feature j produced token j + 1's law, so the last one kept
is h before the new token). Before the first verification: a continued
context (decoder-only) has the prompt's features, so h is the feature of
the second-to-last prompt token; a one-token prompt, or a family whose
decoder starts from its start token alone (T5), has none, and the first
proposal drafts nothing (a plain target step).

Trees: `TreeDraft(medusa, branching=...)`. Depth d's children are drawn from
head d's law (Medusa's own tree construction), whatever their parent: the
law a child was drawn from is head d's, so recursive rejection sampling
stays exact. The tree's root is the chain's end: greedy pending tokens
(`core.tree_decoding`) are handed over by `observe` with their features
(the whole accepted path), so h is always the state before the root, and
the root's children come from head 1 whatever the chain's length.

Params: dict(kernel [num_layers, K, h, h], bias [num_layers, K, h],
lm_head [K, h, vocab] (own heads only)) in the target's dtype, plus
dict(target=...) references to the target's output projection when shared.
"""

from typing import Any, Hashable, Optional

import jax
import jax.numpy as jnp

from specdec_jax.drafts.base import target_features
from specdec_jax.drafts.parallel import ParallelDrafter
from specdec_jax.families.registry import family_of

Array = jax.Array


class MedusaDraft(ParallelDrafter):
  """Medusa-1 heads drafting for their target, chain or tree, in one call per proposal.

  Args:
    target: the target model (any family with `supports_features`: T5's
      decoder hidden state, a decoder-only model's).
    num_heads: K, heads (the longest chain, the deepest tree level drafted
      from a head of its own).
    num_layers: residual SiLU blocks per head.
    seed: for random params (normal(0.02) kernels and LM heads, zero biases).
    share_lm_head: every head ends in the target's own output projection
      (referenced) instead of an LM head of its own.
    params: the heads' arrays (`init_params`' tree); None: random.
  """

  def __init__(self, target, num_heads: int = 4, num_layers: int = 1, seed: int = 0,
               share_lm_head: bool = False, params: Optional[Any] = None):
    for name, value in (("num_heads", num_heads), ("num_layers", num_layers)):
      if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    family = family_of(target)
    self.reads = target_features(None)  # the last hidden state, after the final norm
    self.config = target.config
    self.num_heads = int(num_heads)
    self.num_layers = int(num_layers)
    self.share_lm_head = bool(share_lm_head)
    self.hidden_dim = family.feature_dim(target.config, None)
    self.vocab_size = target.config.vocab_size
    self.eos_id = target.config.eos_id
    self.pad_id = target.config.pad_id
    self.dtype = jnp.dtype(target.config.dtype)
    # The target's output projection, through the family's feature-head contract
    # (`FeatureHead.logits` reads only the target's arrays): no family import here.
    self._projection = family.feature_head(target.config)
    self.projection_refs = self._projection.target_refs(target.params)
    self.target_refs = self.projection_refs if share_lm_head else {}
    self.head_params = self.init_params(seed) if params is None else params
    self._check_params(self.head_params)

  # -- arrays ----------------------------------------------------------------

  def param_shapes(self):
    """{name: shape} of the heads' own arrays."""
    k, h, layers = self.num_heads, self.hidden_dim, self.num_layers
    shapes = dict(kernel=(layers, k, h, h), bias=(layers, k, h))
    if not self.share_lm_head:
      shapes["lm_head"] = (k, h, self.vocab_size)
    return shapes

  def init_params(self, seed: int = 0):
    """Random heads: normal(0.02) kernels and LM heads, zero biases, in the target's dtype."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    shapes = self.param_shapes()
    params = dict(kernel=0.02 * jax.random.normal(keys[0], shapes["kernel"]),
                  bias=jnp.zeros(shapes["bias"]))
    if "lm_head" in shapes:
      params["lm_head"] = 0.02 * jax.random.normal(keys[1], shapes["lm_head"])
    return jax.tree_util.tree_map(lambda x: x.astype(self.dtype), params)

  def _check_params(self, params):
    want = self.param_shapes()
    got = {k: tuple(getattr(v, "shape", ())) for k, v in dict(params).items()}
    if got != want:
      raise ValueError(f"Medusa params {got} do not match {self.num_heads} heads x "
                       f"{self.num_layers} layers for hidden {self.hidden_dim} and vocabulary "
                       f"{self.vocab_size} (expected {want})")

  @property
  def params(self) -> Any:
    return dict(heads=self.head_params, target=self.target_refs)

  def static_key(self) -> Hashable:
    return ("medusa", self.config, self.num_heads, self.num_layers, self.share_lm_head)

  def check_compatible(self, target_config) -> None:
    if target_config != self.config:
      raise ValueError("this MedusaDraft was built for another target config: Medusa heads read "
                       "one target's hidden states (and, shared, its output projection)")

  def grown_params(self, small_target, large_config):
    """The heads read and write a residual stream repeated r times (`widen.medusa_params`)."""
    from specdec_jax.families import widen
    return widen.medusa_params(self.head_params, large_config.emb_dim // self.hidden_dim)

  def with_grown_params(self, large_target, params) -> "MedusaDraft":
    return MedusaDraft(large_target, num_heads=self.num_heads, num_layers=self.num_layers,
                       share_lm_head=self.share_lm_head, params=params)

  @property
  def num_positions(self) -> int:
    """One law per head: the longest chain, the deepest tree level with a head of its own."""
    return self.num_heads

  # -- the heads --------------------------------------------------------------

  def head_logits(self, params, hidden: Array, heads: int) -> Array:
    """hidden [batch, h] -> logits [batch, heads, vocab] float32 of heads 1..heads (one call).

    The heads run as [heads, batch, h]: each head's matmul is a dot batched over its
    leading axis in both operands. XLA's CPU runtime has no kernel for a bfloat16 dot
    accumulated in float32 whose batch axis lies inside an operand ([batch, heads, h]
    against [heads, h, g]), where a program does not fuse it away (it did in the decode,
    not in `tools.profiling.time_proposals`, which gamma='auto' times drafts with).
    """
    own = params["heads"]
    x = jnp.broadcast_to(hidden.astype(self.dtype)[None],
                         (heads, hidden.shape[0], hidden.shape[-1]))
    for j in range(self.num_layers):
      y = jnp.einsum("kbh,khg->kbg", x, own["kernel"][j, :heads].astype(self.dtype),
                     preferred_element_type=jnp.float32)
      bias = own["bias"][j, :heads].astype(jnp.float32)[:, None, :]
      x = x + jax.nn.silu(y + bias).astype(self.dtype)
    if self.share_lm_head:
      logits = self.target_logits(params["target"], x)
    else:
      logits = jnp.einsum("kbh,khv->kbv", x, own["lm_head"][:heads].astype(self.dtype),
                          preferred_element_type=jnp.float32)
    return jnp.swapaxes(logits, 0, 1)

  def target_logits(self, refs, hidden: Array) -> Array:
    """The target's own output projection: hidden [..., h] -> logits [..., vocab] float32
    (refs: `projection_refs`)."""
    return self._projection.logits(None, refs, hidden.astype(self.dtype)).astype(jnp.float32)

  def check_gamma(self, gamma: int) -> None:
    if gamma > self.num_heads:
      raise ValueError(f"gamma={gamma} drafts {gamma} tokens from one hidden state, one head "
                       f"each; this MedusaDraft has {self.num_heads} heads (gamma <= "
                       f"{self.num_heads}, or build it with num_heads={gamma})")

  # -- the decode loop --------------------------------------------------------

  def init_state(self, params, start):
    """dict(hidden [batch, h] float32: h before the row's last token, ready [batch] bool)."""
    del params
    context, features = start.context, start.features
    batch = context.tokens.shape[0]
    hidden = jnp.zeros((batch, self.hidden_dim), jnp.float32)
    ready = jnp.zeros((batch,), jnp.bool_)
    if context.continued and features is not None and features.shape[1] > 0:
      # The loop's first block starts at the last prompt token: h is the feature
      # of the token before it (feature t produced token t + 1's law).
      before_last = context.lengths.astype(jnp.int32) - 2
      rows = jnp.arange(batch)
      hidden = features[rows, jnp.maximum(before_last, 0)].astype(jnp.float32)
      ready = before_last >= 0
    return dict(hidden=hidden, ready=ready)

  def observer(self, params):
    def observe(state, features, tokens, count):
      del tokens
      last = jnp.clip(count - 1, 0, features.shape[1] - 1)
      hidden = features[jnp.arange(features.shape[0]), last].astype(jnp.float32)
      return dict(state, hidden=hidden, ready=jnp.ones_like(state["ready"]))
    return observe

  def block_laws(self, params, state, sequences, lengths, num, window):
    """Heads 1..num on h, the state before the row's last token (one batched call)."""
    del sequences, lengths, window  # h already holds the accepted path (`observe`)
    return self.head_logits(params, state["hidden"], num), state["ready"], state
