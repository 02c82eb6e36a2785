"""Feature drafts (EAGLE, arXiv 2401.15077): a one-layer head over the target's hidden states.

The head reads, at each position, the target's feature there (e.g. its last
hidden state after the final norm) and the next token, and predicts the
next feature, which its `logits` turn into a distribution. Drafting feeds
its own predicted features back. The head itself is the family's (or a
checkpoint format's): any `families.feature_head.FeatureHead`, given by
`Family.feature_head` or passed in prebuilt; this module drives it and
imports no family. EAGLE-1 heads of the built-in families:

    x   = fc([embedding(token_t); feature_{t-1}])           Linear(2h -> h)
    f_t = DecoderLayer(x)   (the target family's layer, input norm dropped,
                             its own KV cache over positions; T5's also
                             cross-attends to the target's encoder outputs)
    p(token_{t+1}) = lm_head(f_t)                            the target's head

(`families/decoder_only/feature_head.py`, `families/t5/feature_head.py`.)

Positions. Head position t holds the pair (feature_{t-1}, token_t) at the
token's absolute position t (position 0's feature is zeros: there is none;
decoder-only heads hide that pair from later queries, as EAGLE has none:
`families.feature_head.pair_visible`), and its output approximates feature_t. After a verification that kept n
drafts from a row at loop length l, the engine hands the draft the target's
features at loop positions l..l+n and the tokens l+1..l+n+1 (the kept drafts
and the correction/bonus token): the n + 1 pairs of token positions
l+1..l+n+1, which the next proposal feeds as one block (writing the head's
cache there) before drafting. Its output at the last pair is the predicted
feature of the bonus token's position, whose logits give x_1; each drafted
x_i is then fed with the previous predicted feature. Keys a proposal wrote
past the kept pairs are overwritten before anything reads them (the causal
mask and the positions' order, as for the target's cache).

The prompt: a decoder-only engine's prefill gives the target's features at
every prompt slot; `init_state` runs the head over the prompt's pairs (its
"prefill") and leaves the last prompt token's pair pending, so the first
proposal drafts x_1 from the head's prediction at the last prompt token. A
family whose decoder starts from its start token alone (T5: the encoder
input is not continued) has no prompt pairs: the pending pair is (zeros,
start token) at position 0, and the memory `start_features` returned (the
encoder outputs) goes to the head's `init_cache` once.

Widths: target features (f wide) pass through the head's `reduce_features`
(identity for EAGLE-1) when they arrive; the state holds them in the head's
width h.

Params: dict(head=the head's own arrays, target=the head's `target_refs`:
references to the target's embedding table, output projection, ... (the
same arrays, not copies; frozen: nothing here trains them)).
"""

from typing import Any, Hashable, Optional

import jax
import jax.numpy as jnp

from specdec_jax.core import sampling
from specdec_jax.drafts.base import Draft, chain_proposer, target_features
from specdec_jax.families.feature_head import FeatureHead
from specdec_jax.families.registry import family_of

Array = jax.Array


class FeatureDraft(Draft):
  """A feature head (EAGLE-style) drafting for its target.

  Args:
    target: the target model (any family with `supports_features`): its
      config shapes the head, its arrays the head reads are referenced (not
      copied).
    head_params: the head's params (its `init_params` tree); None: random.
    seed: for random head params.
    fc_bias: whether fc has a bias (EAGLE-1 config `bias`; an option of the
      family's head, `Family.feature_head`).
    head: a prebuilt `FeatureHead` for this target (e.g. an EAGLE-3 head with
      its own reduced vocabulary); None: the family's EAGLE-1 head.
  """

  def __init__(self, target, head_params=None, seed: int = 0, fc_bias: bool = False,
               head: Optional[FeatureHead] = None):
    family = family_of(target)
    if head is None:
      head = family.feature_head(target.config, fc_bias=fc_bias)
    else:
      if not isinstance(head, FeatureHead):
        raise TypeError(f"head must be a specdec_jax.families.feature_head.FeatureHead, got "
                        f"{type(head).__name__}")
      if fc_bias:
        raise ValueError("fc_bias configures the family's own head; a prebuilt head has its "
                         "own options")
    head.check_target(target.config)
    self.head = head
    self.config = target.config
    self.reads = target_features(head.feature_layers)
    self.feature_dim = family.feature_dim(target.config, head.feature_layers)
    self.head_params = head.init_params(seed) if head_params is None else head_params
    self.target_params = head.target_refs(target.params)
    self.vocab_size = head.vocab_size
    self.eos_id = self.config.eos_id
    self.pad_id = self.config.pad_id

  def grown_params(self, small_target, large_config):
    """The family's EAGLE-1 head grown with its target (`Family.embed_feature_head_params`);
    other heads (EAGLE-3, a prebuilt head) have no growing rule."""
    from specdec_jax.families.widen import EmbeddingError
    family = family_of(small_target)
    own = family.feature_head(small_target.config, **({"fc_bias": True} if self.fc_bias else {}))
    if own.static_key() != self.head.static_key():
      raise EmbeddingError(f"a {type(self.head).__name__} has no function-preserving growing "
                           f"rule; only the {family.name} family's own EAGLE-1 head grows")
    return family.embed_feature_head_params(self.head_params, small_target.config,
                                            large_config)

  def with_grown_params(self, large_target, params) -> "FeatureDraft":
    return FeatureDraft(large_target, head_params=params, fc_bias=self.fc_bias)

  @property
  def fc_bias(self) -> bool:
    return bool(getattr(self.head, "fc_bias", False))

  @property
  def params(self) -> Any:
    return dict(head=self.head_params, target=self.target_params)

  def static_key(self) -> Hashable:
    return ("feature", self.head.static_key())

  def check_compatible(self, target_config) -> None:
    if target_config != self.config:
      raise ValueError("this FeatureDraft was built for another target config: a feature head "
                       "reads one target's hidden states, embedding and LM head")

  def _apply(self, params, tokens, features, positions, cache, tree=None):
    if tree is None:  # a head that scores no trees may take no tree argument
      return self.head.apply(params["head"], params["target"], tokens, features, positions,
                             cache)
    return self.head.apply(params["head"], params["target"], tokens, features, positions, cache,
                           tree)

  def _draft_step(self, params, tokens, features, positions, cache, step: int, context_end):
    """Chain step `step` >= 1 of a proposal: the head on (its own previous output, x_step)
    at `positions` [batch] (`context_end` [batch]: where the accepted context ends). A
    draft of several heads (`MtpDraft`) picks the one for this step."""
    del step, context_end
    return self._apply(params, tokens, features, positions, cache)

  def _step_logits(self, params, hidden, step: int):
    """The law's logits at chain step `step` (0-based) from the head's output."""
    del step
    return self.head.logits(params["head"], params["target"], hidden)

  def _reduce(self, params, features):
    return self.head.reduce_features(params["head"], params["target"],
                                     features.astype(jnp.float32)).astype(jnp.float32)

  def init_state(self, params, start):
    """The head's cache and the pending pairs of the first proposal.

    From the `DraftStart`: features, the target's features at the decoder
    prompt's slots [batch, P, f] (`Family.start_features`: P = C for a
    continued context, 0 for T5), None only in shape queries (zeros);
    memory, what `start_features` returned beside them (None: none, or a
    shape query: the head's placeholder); decode, the target's `DecodeStart`
    (first inputs and offsets; None: for a continued context derived from
    it, the same values; otherwise zeros, in shape queries); gamma, the
    deepest proposal (the pending pairs' room).
    """
    head = self.head
    context, features, memory = start.context, start.features, start.memory
    max_decode_len, gamma, decode = start.max_decode_len, int(start.gamma), start.decode
    tokens, lengths = context.tokens, context.lengths
    batch, width = tokens.shape
    h = head.hidden_dim
    rows = jnp.arange(batch)
    if memory is None and features is None:
      memory = head.placeholder_memory(batch, width)
    room = (width if context.continued else 0) + max_decode_len + gamma
    cache = head.init_cache(params["head"], batch, room, memory)
    pending_features = jnp.zeros((batch, gamma + 1, h), jnp.float32)
    pending_tokens = jnp.zeros((batch, gamma + 1), jnp.int32)
    if context.continued:
      if features is None:
        features = jnp.zeros((batch, width, self.feature_dim), jnp.float32)
      # Pair t = (feature_{t-1}, token_t); token 0 has no feature before it.
      shifted = jnp.concatenate([jnp.zeros((batch, 1, h), jnp.float32),
                                 self._reduce(params, features[:, :-1])], axis=1)
      _, cache = self._apply(params, tokens, shifted, jnp.zeros((batch,), jnp.int32), cache)
      last = lengths - 1
      pending_features = pending_features.at[:, 0].set(shifted[rows, last])
      pending_tokens = pending_tokens.at[:, 0].set(tokens[rows, last])
      offset = last.astype(jnp.int32)
    else:
      # The decoder starts from its first input alone (T5's start token at
      # position 0): its pair has no feature before it, and nothing precedes it.
      first = (jnp.zeros((batch,), jnp.int32) if decode is None else
               decode.first_inputs.astype(jnp.int32))
      pending_tokens = pending_tokens.at[:, 0].set(first)
      offset = (jnp.zeros((batch,), jnp.int32) if decode is None else
                decode.offset.astype(jnp.int32))
    return dict(cache=cache, pending_features=pending_features, pending_tokens=pending_tokens,
                count=jnp.ones((batch,), jnp.int32), offset=offset)

  def observer(self, params):
    def observe(state, features, tokens, count):
      return dict(state, pending_features=self._reduce(params, features),
                  pending_tokens=tokens.astype(jnp.int32), count=count.astype(jnp.int32))
    return observe

  def proposer(self, params, plan):
    gamma, settings = plan.gamma, plan.sampling

    def draw(hidden, step_rng, step):
      probs = settings.probs(self._step_logits(params, hidden, step))
      return settings.draw(step_rng, probs), probs

    def propose(rng, state, sequences, lengths, max_drafted=None):
      batch = sequences.shape[0]
      rows = jnp.arange(batch)
      offset, count = state["offset"], state["count"]
      limit = (jnp.full((batch,), gamma, jnp.int32) if max_drafted is None else
               jnp.clip(max_drafted, 1, gamma).astype(jnp.int32))
      rngs = sampling.split_keys(rng, gamma)
      # The pending pairs: token positions lengths - count + 1 .. lengths.
      hidden, cache = self._apply(params, state["pending_tokens"], state["pending_features"],
                                  lengths - count + 1 + offset, state["cache"])
      last = hidden[rows, jnp.clip(count - 1, 0, hidden.shape[1] - 1)]
      token, probs = draw(last, rngs[0], 0)
      tokens, laws = [token], [probs]
      for i in range(1, gamma):
        # Feeds (predicted feature of position lengths + i - 1, x_i) at lengths + i.
        hidden, cache = self._draft_step(params, token[:, None], last[:, None],
                                         lengths + i + offset, cache, i, lengths + offset)
        last = hidden[:, 0]
        token, probs = draw(last, rngs[i], i)
        tokens.append(token)
        laws.append(probs)
      keep = jnp.arange(gamma)[None] < limit[:, None]
      draft_tokens = jnp.where(keep, jnp.stack(tokens, axis=1), 0)
      draft_probs = jnp.where(keep[..., None], jnp.stack(laws, axis=1), 0.0)
      return draft_tokens, draft_probs, limit, dict(state, cache=cache)

    return chain_proposer(propose, plan, observe=self.observer(params))

  def tree_expander(self, params, settings):
    """Scores tree nodes with the head (`drafts.tree_draft.TreeExpander`): `TreeDraft(FeatureDraft
    (target), ...)` and `DynamicTreeDraft(...)` grow trees from the head's laws.

    `start` feeds the pairs the loop handed over (`TreeProposer.observe`: the
    accepted path with the target's features, greedy pending tokens
    included, so they end at the chain's end, the sub-tree's root) and keeps
    the head's output there as the root's predicted feature. `expand` feeds
    one depth of nodes, each paired with its parent's predicted feature
    (the parent read off the tree's visibility: the visible slot one depth
    up), with the tree's attention over the head's cache, and keeps their
    outputs for their children. `move` leaves the cache as it is: the next
    `start` re-feeds the accepted path, with the target's features instead
    of the head's guesses, over the same positions (as the chain does).
    State: the head's predicted feature at each of a tree's draft slots,
    `node_hidden` [batch, slots, h] (float32; `init`).
    """
    from specdec_jax.drafts.tree_draft import TreeExpander  # tree.py imports drafts
    head = self.head

    def laws(hidden):
      logits = head.logits(params["head"], params["target"], hidden)
      scores = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      return scores, settings.probs(logits)

    def init(state, batch, slots):
      return dict(state, node_hidden=jnp.zeros((batch, slots, head.hidden_dim), jnp.float32))

    def start(state, sequences, lengths, chain, chain_len):
      rows = jnp.arange(sequences.shape[0])
      count = state["count"]
      end = lengths + chain_len  # the chain's end: the last pair's token position
      hidden, cache = self._apply(params, state["pending_tokens"], state["pending_features"],
                                  end - count + 1 + state["offset"], state["cache"])
      root = hidden[rows, jnp.clip(count - 1, 0, hidden.shape[1] - 1)].astype(jnp.float32)
      scores, probs = laws(root)
      return scores, probs, dict(state, cache=cache,
                                 node_hidden=state["node_hidden"].at[:, 0].set(root))

    def expand(state, lengths, chain_len, tokens, attention, block_offset):
      # Each node's parent: the slot it sees one depth above its own.
      parent_depth = attention.slot_depths[:, None, :] == attention.depths[:, :, None] - 1
      parent = jnp.argmax(attention.visible & parent_depth, axis=-1)  # [batch, n]
      parent_hidden = jnp.take_along_axis(state["node_hidden"], parent[:, :, None], axis=1)
      positions = lengths + chain_len + block_offset + state["offset"]
      hidden, cache = self._apply(params, tokens, parent_hidden, positions, state["cache"],
                                  tree=attention)
      hidden = hidden.astype(jnp.float32)
      scores, probs = laws(hidden)
      node_hidden = jax.lax.dynamic_update_slice_in_dim(state["node_hidden"], hidden,
                                                        block_offset, axis=1)
      return scores, probs, dict(state, cache=cache, node_hidden=node_hidden)

    def move(state, lengths, sources):
      return state

    return TreeExpander(start, expand, move, init)
