"""The feature-head contract: what a family gives a feature draft (EAGLE-style heads).

A feature head reads, at each position, a feature of the target (its hidden
state there) and the next token, and predicts the next feature, from which
logits follow. `drafts.FeatureDraft` drives any head through this class
alone, so a family (or a head format such as EAGLE-3's) adds a head by
subclassing it; the draft imports no family.

The pairing (every head): head position t holds the pair (feature_{t-1},
token_t) at the token's absolute position t and its output approximates
feature_t (position 0 has no feature before it: zeros). Drafting feeds the
head its own output as the next pair's feature. Decoder-only heads, whose
public checkpoints (EAGLE-1, EAGLE-3) were trained without that zero pair,
hide it from later queries (`pair_visible`); T5's head, which has no public
format and whose pair 0 is its start token, sees it.

Widths: the target's features are f = `Family.feature_dim(config,
feature_layers)` wide; `reduce_features` maps them to the head's own width
h = `hidden_dim` (the identity for EAGLE-1 heads, whose f = h; EAGLE-3's fc
over 3 concatenated layers), and `apply` reads features of width h: reduced
target features, or the head's own previous output.

Arrays: `init_params` are the head's own (trained) arrays; `target_refs` are
the target's arrays the head reads (embedding table, output projection,
learned positions...), the same arrays, not copies (frozen). Both travel
into the compiled decode as arguments (`FeatureDraft.params`), so new
weights never recompile; everything static is in `static_key`.

Memory: what a family's `start_features` returns beside the features (None
for decoder-only; T5: the target's encoder outputs and mask), from which a
head computes once, in `init_cache`, what it attends to besides its own
keys (T5: its cross-attention keys/values).
"""

import abc
from typing import Any, Hashable, Tuple

import jax

Array = jax.Array


def eagle3_taps(num_layers: int) -> Tuple[int, ...]:
  """EAGLE-3's three feature taps for a stack of `num_layers` layers.

  EAGLE's target code (`modeling_llama_kv.py` and its Qwen siblings) appends
  the input of decoder layer idx, for idx = 0..L-1 in order, whenever idx is
  2, L // 2 or L - 3: the distinct members of that set inside [0, L), in
  ascending order (HF `hidden_states` indices). Its fc reads exactly three,
  so the set is defined for L = 3 ((0, 1, 2)) and L >= 7 ((2, L // 2, L - 3));
  for L = 4..6 two coincide and for L < 3 some fall outside, and EAGLE itself
  cannot run: an error here, naming explicit taps as the way out.
  """
  num = int(num_layers)
  taps = tuple(i for i in range(num) if i in (2, num // 2, num - 3))
  if len(taps) != 3:
    raise ValueError(f"EAGLE-3 taps the inputs of layers 2, L//2 and L-3, three distinct layers "
                     f"only for targets of 3 or at least 7 layers; this target has {num} "
                     f"(distinct taps {taps}). Pass explicit feature layers (a tuple of "
                     f"hidden-state indices in [0, {num}]) to train a multi-layer head of your "
                     f"own; no public EAGLE-3 head exists for such a target")
  return taps


def feature_taps(num_layers: int, layers=None) -> Tuple[int, ...]:
  """The hidden-state indices a feature set names, for a stack of `num_layers` layers.

  None or "last": (num_layers,), the output after the final norm (EAGLE-1).
  "eagle3": `eagle3_taps`, the inputs of an early, a middle and a late layer
  in EAGLE-3's order (HF `hidden_states` indices). A sequence of ints: those
  indices, each in [0, num_layers] (i < L: layer i's input, 0 the embedded
  tokens; L: after the final norm), in that order.
  """
  num = int(num_layers)
  if layers is None or layers == "last":
    return (num,)
  if layers == "eagle3":
    return eagle3_taps(num)
  if isinstance(layers, str):
    raise ValueError(f"feature layers must be None, 'last', 'eagle3' or ints, got {layers!r}")
  layers = tuple(int(i) for i in layers)
  if not layers or any(i < 0 or i > num for i in layers):
    raise ValueError(f"feature layers {layers} must be a non-empty sequence of hidden-state "
                     f"indices in [0, {num}] (this model has {num} layers)")
  return layers


def pair_visible(key_at: Array, query_at: Array) -> Array:
  """Which head keys a head query sees: causal, and the zero first pair hidden.

  The engine feeds pair (feature_{t-1}, token_t) at absolute position t, so
  position 0 holds (zeros, token_0): no feature precedes the first token.
  EAGLE (EAGLE-1 `cnets1.py`, EAGLE-3 `cnets.py`) has no such pair: its pairs
  are (h_t, token_{t+1}) from t = 0, in training and in drafting. So a query
  past position 0 does not see key 0, and every other pair sits one position
  later than in EAGLE's code, which rotary attention cannot tell apart
  (scores depend on position differences only). Query 0 sees key 0 alone
  (a one-token prompt's first proposal has nothing else). Broadcasting
  int arrays of absolute positions -> bool.
  """
  return (key_at <= query_at) & ((key_at > 0) | (query_at == 0))


class FeatureHead(abc.ABC):
  """A feature head for one target config (static; arrays live in params / refs).

  Attributes:
    config: the target's config (a head serves the target it was built for).
    feature_layers: which target features it reads (`Family.feature_dim`'s
      `layers`: None / "last", "eagle3" or a tuple of indices).
    vocab_size: the target's vocabulary (what `logits` returns over).
    hidden_dim: h, the width of `apply`'s features and outputs.
  """
  config: Any
  feature_layers: Any = None

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def hidden_dim(self) -> int:
    return self.config.emb_dim

  @abc.abstractmethod
  def static_key(self) -> Hashable:
    """Hashable: everything static about the head (part of the compile key)."""

  @abc.abstractmethod
  def init_params(self, seed: int = 0) -> Any:
    """Random head params (a pytree), in `config.dtype`."""

  @abc.abstractmethod
  def target_refs(self, target_params) -> Any:
    """The target arrays the head reads, a pytree of references into target_params."""

  def reduce_features(self, params, refs, features: Array) -> Array:
    """Target features [..., f] float32 -> the head's width [..., hidden_dim]
    (default: the identity, f = hidden_dim)."""
    return features

  @abc.abstractmethod
  def init_cache(self, params, batch: int, max_len: int, memory=None) -> Any:
    """The head's cache for `batch` rows of `max_len` positions (traceable).

    memory: what the family's `start_features` returned beside the features
      (None for families without one).
    """

  def placeholder_memory(self, batch: int, context_width: int) -> Any:
    """A memory of the right structure and shapes (zeros) for shape queries,
    where no target ran (the memory planner); None for heads that read none."""
    return None

  @abc.abstractmethod
  def apply(self, params, refs, tokens: Array, features: Array, positions: Array,
            cache, tree=None) -> Tuple[Array, Any]:
    """Scores k pairs per row from the cache.

    Args:
      params, refs: `init_params`' and `target_refs`' trees.
      tokens: [batch, k] int32, token_t of each pair.
      features: [batch, k, hidden_dim], feature_{t-1} of each pair (reduced).
      positions: [batch] int32, the cache index of each row's first pair: the
        head's own keys of pair i are set at positions + i. Without a tree it
        is also pair 0's absolute position t (pair i at t + i).
      cache: from `init_cache`.
      tree: None, or a `core.token_tree.TreeAttention` (a token tree's nodes, one
        depth at a time, `FeatureDraft.tree_expander`): pair i then sits at
        absolute position root + tree.depths[i] (root = positions -
        tree.root_offset) and sees what `core.token_tree.tree_positions` allows,
        as in a family's tree block.
    Returns:
      (hidden [batch, k, hidden_dim], the predicted feature_t of each pair,
      in config.dtype or float32; cache).
    """

  def token_embeddings(self, refs, ids: Array) -> Array:
    """The target's raw input embedding rows of ids [...] -> [..., emb] (the table itself,
    no family scaling): what drafts that embed tokens with the target's table read
    (`drafts.DFlashDraft`). refs: `target_refs`."""
    raise NotImplementedError(f"{type(self).__name__} does not expose the target's token "
                              "embedding")

  @abc.abstractmethod
  def logits(self, params, refs, hidden: Array) -> Array:
    """hidden [..., hidden_dim] -> logits [..., vocab_size] float32 over the target's
    vocabulary (a head with its own reduced vocabulary maps its ids to the
    target's, with the tokens it cannot draft at -inf)."""

  def check_target(self, target_config) -> None:
    """Raises ValueError if the head cannot serve a target of target_config."""
    if target_config != self.config:
      raise ValueError("this feature head was built for another target config: a feature head "
                       "reads one target's hidden states, embedding and output projection")
