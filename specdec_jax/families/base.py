"""The family contract: what a model family gives the one engine.

The engine (`generate`, the drafts, loading, sharding, training, the tools)
calls a family through this class and nothing else, so a new family is a new
folder that implements it and registers itself (`families.register`); no
engine module changes. T5 (`families/t5`) and decoder-only
(`families/decoder_only`) are its two implementations.

Vocabulary (shapes in every docstring):
* *inputs*: what a user hands `generate`: tokens [batch, C] int32 and, where
  the family reads them, per-row lengths [batch] int32 (right padding).
* *context*: what drafts read of the inputs (`Context`): the T5 encoder
  tokens, or a decoder-only prompt. `Context.continued` says whether the
  generated tokens continue it (decoder-only) or follow it as a separate
  sequence (T5).
* *loop positions*: the decode loops (`core/decoding.py`) number each row's
  decoder inputs from 0, loop position 0 holding the row's first input.
  `DecodeStart.offset` is the absolute position of loop position 0, so a
  block callback at absolute positions serves the loops after a shift.
* *block callback*: `(tokens [batch, k] int32, positions [batch] int32,
  cache, tree=None) -> (logits [batch, k, vocab] float32, cache)`, scoring k
  tokens of each row from its own position; target and draft use the same
  one. Block token i's keys/values are set at cache index positions + i.
  `tree` is None (a causal block: token i at absolute position
  positions + i; no tree masks are traced) or a
  `core.token_tree.TreeAttention` (the block is nodes of a token tree: token i at
  position root + tree.depths[i], attending to the prefix and to the tree
  slots it sees; see its docstring). Only families with `supports_trees`
  take a tree: wrappers check with `Family.check_tree` and forward with
  `call_block`, which leaves the argument out when it is None, so a
  callback that knows nothing of trees (three arguments) stays valid.
* *token trees*: `Family.move_cache` moves an accepted tree path's keys and
  values from their tree slots to their chain positions.
* *features* (families with `supports_features`; feature drafts such as
  `drafts.FeatureDraft`): `Family.feature_block_fn` is a causal block
  callback `(tokens, positions, cache) -> (logits, features [batch, k, f]
  float32, cache)` that also returns hidden states of the target for each
  block token (the token's own state, which produced its logits): the last
  layer's after the final norm (EAGLE-1) or a chosen set of layers
  concatenated (EAGLE-3); `Family.start_features` is `start` plus the
  prompt's features and the memory a head reads (T5's encoder outputs).
  A separate callback, so decoding without a feature draft traces no
  features. `Family.feature_head` gives the family's head
  (`families.feature_head.FeatureHead`, the contract `drafts.FeatureDraft`
  drives). `Family.teacher_features` is the training side: a training
  batch's teacher-forced features, the tokens they pair with, the weights and
  the memory (`train/feature_heads.py` and `train/medusa.py` read nothing else of
  a family).
* *head formats*: public checkpoints of trained heads (EAGLE-1, EAGLE-3,
  Medusa-1) register in `families/head_formats.py`, each naming the
  families it serves; a family registers its own formats.
"""

import abc
import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
# (tokens, positions, cache[, tree]) -> (logits, cache); see the module docstring.
BlockFn = Callable[..., Tuple[Array, Any]]
LogicalAxes = Tuple[Optional[str], ...]


@flax.struct.dataclass
class Context:
  """What drafts read of a decode's inputs.

  tokens: [batch, C] int32, right-padded; row b's context is tokens[b, :lengths[b]].
  lengths: [batch] int32.
  continued: static: True when the generated tokens continue the context
    (a decoder-only prompt), False when they follow it as a separate
    sequence (T5's encoder input).
  """
  tokens: Array
  lengths: Array
  continued: bool = flax.struct.field(pytree_node=False, default=False)

  def mask(self) -> Array:
    """[batch, C] bool: the real context positions."""
    return jnp.arange(self.tokens.shape[1])[None] < self.lengths[:, None]


@flax.struct.dataclass
class DecodeStart:
  """How a decode starts (traced).

  cache: the family's cache pytree, with the context encoded or prefilled.
  first_inputs: [batch] int32, each row's decoder input at loop position 0.
  offset: [batch] int32, the absolute position of loop position 0.
  """
  cache: Any
  first_inputs: Array
  offset: Array


def check_tokens(tokens, name: str = "encoder_tokens") -> Array:
  """Validates int tokens [batch, len] and returns them as int32."""
  shape = getattr(tokens, "shape", None)
  dtype = getattr(tokens, "dtype", None)
  if shape is None or dtype is None:
    tokens = np.asarray(tokens)
    shape, dtype = tokens.shape, tokens.dtype
  if len(shape) != 2:
    raise ValueError(f"{name} must have rank 2 [batch, length], got shape {tuple(shape)}")
  if not np.issubdtype(dtype, np.integer):
    raise ValueError(f"{name} must be integer token ids, got dtype {dtype}")
  if shape[0] < 1 or shape[1] < 1:
    raise ValueError(f"{name} must be non-empty, got shape {tuple(shape)}")
  return jnp.asarray(tokens, jnp.int32)


def check_block(tokens, positions, max_len: int) -> Tuple[Array, Array]:
  """Validates a block [batch, k] at positions [batch] against a cache of `max_len`
  positions (the positions' range only when they are concrete); returns int32 arrays."""
  tokens = check_tokens(tokens, "tokens")
  positions = jnp.asarray(positions, jnp.int32)
  if positions.shape != (tokens.shape[0],):
    raise ValueError(f"positions must be [batch] = ({tokens.shape[0]},), got {positions.shape}")
  if tokens.shape[1] > max_len:
    raise ValueError(f"a block of {tokens.shape[1]} tokens is longer than the cache "
                     f"({max_len} positions)")
  if not isinstance(positions, jax.core.Tracer):
    end = int(jnp.max(positions)) + tokens.shape[1]
    if int(jnp.min(positions)) < 0 or end > max_len:
      raise ValueError(f"block positions [{int(jnp.min(positions))}, {end}) fall outside the "
                       f"cache of {max_len} positions")
  return tokens, positions


def leaf_and_parent(path: Sequence[str]) -> Tuple[str, str]:
  """A parameter path's last two names ('' where the path is shorter)."""
  path = tuple(path)
  return (path[-1] if path else ""), (path[-2] if len(path) > 1 else "")


def replace_config(config, overrides: Mapping[str, Any]):
  """`dataclasses.replace` that names unknown fields instead of a TypeError."""
  known = {f.name for f in dataclasses.fields(config)}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise ValueError(f"Unknown {type(config).__name__} field(s) {unknown}; known: "
                     f"{sorted(known)}")
  return dataclasses.replace(config, **overrides)


def checked_axes(path: Sequence[str], axes: Optional[LogicalAxes], ndim: int,
                 tree: str) -> LogicalAxes:
  """A parameter's logical axes, or a ValueError naming the parameter (unknown to
  the family's `tree`, or of the wrong rank)."""
  name = "/".join(path)
  if axes is None:
    raise ValueError(f"no logical axes known for parameter {name!r}: expected {tree}")
  if len(axes) != ndim:
    raise ValueError(f"parameter {name!r} has rank {ndim}, expected {len(axes)} for logical "
                     f"axes {axes}")
  return axes


@dataclasses.dataclass(frozen=True, eq=False)
class FamilyModel:
  """A family's network config and its parameters (a family's `model_type` subclasses it).

  Attributes:
    config: the family's config.
    params: the parameter tree, arrays in `config.dtype`.
  """
  config: Any
  params: Any

  network = None  # The family's flax module class, built from the config.

  @property
  def module(self):
    return self.network(self.config)

  @property
  def variables(self):
    return {"params": self.params}


def path_names(path) -> Tuple[str, ...]:
  """The key names of a `jax.tree_util` path, e.g. ('decoder', 'layers_0', 'kernel')."""
  names = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
  return tuple(names)



def call_block(block_fn: BlockFn, tokens: Array, positions: Array, cache, tree=None):
  """`block_fn(tokens, positions, cache, tree)`, leaving the tree out when it is None:
  wrappers of block callbacks forward a tree through this, so they also wrap
  callbacks that take no tree (families without `supports_trees`)."""
  if tree is None:
    return block_fn(tokens, positions, cache)
  return block_fn(tokens, positions, cache, tree)


def shift_block_fn(block_fn: BlockFn, offset: Array) -> BlockFn:
  """A block callback at absolute positions, shifted to loop positions by `offset` [batch].

  A tree passes through unchanged: its root_offset counts from the block's
  first token, whatever the positions are numbered from.
  """
  return lambda tokens, positions, cache, tree=None: call_block(
      block_fn, tokens, positions + offset, cache, tree)


def _move_along(leaf: Array, axis: int, positions: Array, sources: Array) -> Array:
  """`Family.move_cache` on one leaf whose cache index is dimension `axis` (batch first).

  Indexes the leaf as it lies (no transpose of the cache): a gather of the m
  sources, then a scatter of them at positions + 0..m-1.
  """
  rows = jnp.arange(leaf.shape[0])[:, None]
  between = (slice(None),) * (axis - 1)
  read = jnp.clip(positions[:, None] + sources, 0, leaf.shape[axis] - 1)
  moved = leaf[(rows,) + between + (read,)]  # every read happens before any write
  write = positions[:, None] + jnp.arange(sources.shape[1])[None, :]
  return leaf.at[(rows,) + between + (write,)].set(moved, mode="drop")


class Family(abc.ABC):
  """A model family, as the engine sees it. Instances are stateless and hashable.

  Attributes:
    name: short name ('t5', 'decoder_only').
    config_type: the family's frozen config dataclass.
    model_type: the family's model class, built as `model_type(config, params)`.
    supports_trees: whether the family's block callback takes a `tree`
      (`core.token_tree.TreeAttention`) and the family implements
      `self_attention_cache` (so `move_cache` works). False by default: such
      a family decodes chains only, and `check_tree` / `move_cache` refuse a
      tree for it by name.
    supports_sparse_view: whether `sparse_view` gives a budgeted view of the cache
      (`SparseCacheDraft`); False by default.
  """
  name: str
  config_type: type
  model_type: type
  supports_trees: bool = False
  supports_features: bool = False
  supports_sparse_view: bool = False

  def __repr__(self) -> str:
    return f"<family {self.name}>"

  # -- Configs and parameters ------------------------------------------------

  @abc.abstractmethod
  def named_configs(self) -> Mapping[str, Any]:
    """{name: config} of the family's named sizes."""

  def lookup_config(self, name: str) -> Optional[Any]:
    """The named config spelled `name` (families may accept spellings), or None."""
    return self.named_configs().get(name)

  @abc.abstractmethod
  def init_params(self, config, seed: int = 0) -> Any:
    """Random parameters of `config`, in `config.dtype`."""

  @abc.abstractmethod
  def abstract_params(self, config) -> Any:
    """ShapeDtypeStructs of the parameters (no allocation)."""

  # -- Decoding --------------------------------------------------------------

  @abc.abstractmethod
  def check_inputs(self, config, tokens: Array, lengths, max_decode_steps: int
                   ) -> Tuple[Array, Array]:
    """Validates a decode's inputs on the host; returns (tokens [batch, C] int32,
    lengths [batch] int32). Raises ValueError naming the problem and the fix
    (ids outside the vocabulary, bad or missing lengths, real tokens, the
    longest row's not the padded width, past the positions the model has),
    in one sentence a caller may extend."""

  @abc.abstractmethod
  def context(self, tokens: Array, lengths: Array) -> Context:
    """The drafts' view of the inputs (traced)."""

  @abc.abstractmethod
  def start(self, config, params, tokens: Array, lengths: Array,
            max_decode_steps: int) -> DecodeStart:
    """The cache with the context encoded / prefilled, room for
    `max_decode_steps` loop positions, and where the loop starts (traced)."""

  @abc.abstractmethod
  def block_fn(self, config, params) -> BlockFn:
    """The block callback at absolute positions for (traced) params."""

  @abc.abstractmethod
  def cache_length(self, config, context_width: int, max_decode_steps: int) -> int:
    """Self-attention positions per row that `start` allocates."""

  # -- Features (feature drafts) --------------------------------------------

  def _no_features(self) -> ValueError:
    return ValueError(f"the {self.name} family does not expose its hidden states to drafts "
                      f"({type(self).__name__}.supports_features is False): a draft that "
                      "reads them (FeatureDraft, MedusaDraft) cannot serve it")

  def feature_dim(self, config, layers=None) -> int:
    """The width f of the features `layers` selects (None: the last layer's, after
    the final norm; "eagle3": an early, a middle and a late layer's)."""
    raise self._no_features()

  def start_features(self, config, params, tokens: Array, lengths: Array,
                     max_decode_steps: int, layers=None) -> Tuple[DecodeStart, Array, Any]:
    """`start`, the target's features at the decoder prompt's slots and the memory
    a feature head reads (traced): (DecodeStart, features [batch, P, f] float32,
    memory). A context that the generated tokens continue (decoder-only) is the
    decoder prompt (P = C; slot j: the token at absolute position j); a family
    whose decoder starts from a start token alone (T5) has P = 0. memory: None,
    or what the family's heads attend to besides their own keys (T5: the
    encoder outputs and mask; `FeatureHead.init_cache`)."""
    raise self._no_features()

  def feature_block_fn(self, config, params, layers=None) -> Callable[..., Tuple[Array, Array, Any]]:
    """`(tokens [batch, k], positions [batch], cache, tree=None) -> (logits [batch, k,
    vocab] float32, features [batch, k, f] float32, cache)` at absolute positions: the
    block callback's logits and cache, and each block token's features (with a
    `TreeAttention`, a tree block's, for families with `supports_trees`)."""
    raise self._no_features()

  def feature_head(self, config, **options):
    """The family's feature head (`families.feature_head.FeatureHead`) for a target of
    `config`; options are the head's (e.g. decoder-only `fc_bias`)."""
    raise self._no_features()

  # -- Function-preserving embedding (the cost-realistic pair) --------------

  def embedded_config(self, config, shape, dtype: Optional[str] = None):
    """The large config `embed_model` would build from `config` for `shape` (a named config
    or a config), checked; raises `widen.EmbeddingError` naming what cannot carry over."""
    raise self._no_embedding()

  def embed_params(self, params, config, large):
    """`params` of `config` grown to `large` computing the same function (`families.widen`)."""
    raise self._no_embedding()

  def embed_feature_head_params(self, head_params, config, large):
    """A feature head of the small target grown to drive the embedded one, same function."""
    raise self._no_embedding()

  def _no_embedding(self) -> ValueError:
    from specdec_jax.families.widen import EmbeddingError
    return EmbeddingError(f"the {self.name} family has no function-preserving embedding into "
                          "a larger shape")

  # -- Sparse views (self-speculation) --------------------------------------

  def sparse_view(self, config, params):
    """A `families.sparse_view.SparseView` of this family's cache for a target of `config`
    with `params` (traced), which `drafts.sparse_cache.SparseCacheDraft` drafts through.
    The default says the family gives none."""
    raise ValueError(f"the {self.name} family gives no budgeted view of its cache "
                     f"({type(self).__name__}.sparse_view): a SparseCacheDraft cannot serve "
                     "it; use a model, n-gram or prompt-lookup draft")

  def check_sparse_budget(self, config, budget: int) -> None:
    """Raises ValueError when a view of `budget` positions would read what a target of
    `config` reads anyway (nothing to gain); the default finds nothing to refuse."""

  # -- Token trees -----------------------------------------------------------

  def _no_trees(self, what: str) -> ValueError:
    return ValueError(f"the {self.name} family does not support token trees "
                      f"({type(self).__name__}.supports_trees is False): {what}; decode it "
                      "with a chain draft")

  def check_tree(self, tree) -> None:
    """Raises ValueError when `tree` is not None and the family takes no trees.

    Wrappers of a family's block callback call it before passing a tree on,
    so a tree decode of a chain-only family fails at trace time, by name,
    not as a TypeError deep inside its callback.
    """
    if tree is not None and not self.supports_trees:
      raise self._no_trees("its block callback scores causal blocks only")

  def self_attention_cache(self, cache) -> Any:
    """The cache tree with True at each leaf of per-position self-attention
    state (keys/values indexed by cache index along their "length" logical
    axis, set by the block callback) and False elsewhere (cross-attention
    keys/values, encoder masks: all that `move_cache` must leave alone).
    Families with `supports_trees` implement it."""
    raise self._no_trees("its cache holds no tree state to move")

  def move_cache(self, cache, positions: Array, sources: Array):
    """Moves an accepted tree path's self-attention state into chain order (traced).

    For each row b and t < m, the keys/values at cache index positions[b] + t
    take the values that were at positions[b] + sources[b, t]: every read
    happens before any write. Writes past the cache's end are dropped, reads
    past it clamped (both belong to tokens past the decode length).
    Everything else (entries outside [positions, positions + m), the leaves
    that `self_attention_cache` marks False) is returned as is, bit for bit.

    Args:
      cache: the family's cache.
      positions: [batch] int32, the cache index of each row's tree root.
      sources: [batch, m] int32 tree slots, e.g. the accepted path's slots
        (sources[:, 0] = 0, the root) for a path of m - 1 drafted tokens.
    Returns:
      the cache, same structure, shapes and dtypes.
    """
    if not self.supports_trees:
      raise self._no_trees("its cache holds no tree state to move")
    positions = jnp.asarray(positions, jnp.int32)
    sources = jnp.asarray(sources, jnp.int32)
    axes = self.cache_logical_axes(cache)
    moving = self.self_attention_cache(cache)

    def move(leaf, leaf_axes, moves):
      if not moves:
        return leaf
      if "length" not in leaf_axes or leaf_axes.index("length") < 1:
        raise ValueError(f"a self-attention cache leaf of logical axes {leaf_axes} has no "
                         "'length' axis after its batch axis to move along")
      return _move_along(leaf, leaf_axes.index("length"), positions, sources)

    return jax.tree_util.tree_map(move, cache, axes, moving)

  def text_inputs(self, config, rows: Sequence[Sequence[int]], width: int
                  ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """What `generate` reads for tokenized texts (the launcher's text in).

    rows: one id list per text, as the checkpoint's own tokenizer encodes it
      (its special tokens included: a Llama or Gemma BOS, a T5 EOS).
    width: the inputs' width C (the launcher's MAX_INPUT_LENGTH).
    Returns (inputs [n, width] int32, prompt_lengths [n] int32 or None), the
    arguments `generate(model, inputs, prompt_lengths)` takes.

    This default is a prompt that the generated tokens continue: each row as
    it is, right-padded with `config.pad_id`, with its length. A row longer
    than `width` is a ValueError naming it: cutting a prompt would change
    what it continues. Families whose inputs follow another convention
    (T5's EOS-terminated encoder tokens) override it.
    """
    inputs = np.full((len(rows), width), config.pad_id, np.int32)
    lengths = np.zeros((len(rows),), np.int32)
    for i, row in enumerate(rows):
      if not len(row):
        raise ValueError(f"input {i} tokenizes to no tokens: a prompt needs at least one")
      if len(row) > width:
        raise ValueError(f"input {i} has {len(row)} tokens, more than the inputs' width "
                         f"{width}")
      inputs[i, :len(row)] = row
      lengths[i] = len(row)
    return inputs, lengths

  def eos_id(self, config) -> int:
    """The id that ends a row (-1: no token does)."""
    return -1 if config.eos_id is None else int(config.eos_id)

  def check_draft(self, draft_config, target_config) -> None:
    """Raises ValueError if a model of `draft_config` cannot draft for `target_config`."""
    if draft_config.vocab_size != target_config.vocab_size:
      raise ValueError(f"draft vocabulary size {draft_config.vocab_size} differs from the "
                       f"target's {target_config.vocab_size}: speculative decoding needs one "
                       "vocabulary")

  # -- Training --------------------------------------------------------------

  @abc.abstractmethod
  def token_logits(self, config, params, batch: Mapping[str, Array]
                   ) -> Tuple[Array, Array, Array]:
    """Teacher-forced logits of a training batch (the family's batch dict):
    (logits [batch, L, vocab] float32, targets [batch, L] int32, weights
    [batch, L] float32, 1 = a token to learn). Traced."""

  @abc.abstractmethod
  def continuation_batch(self, config, tokens, lengths, sequences, sequence_lengths
                         ) -> Mapping[str, np.ndarray]:
    """The training batch (what `token_logits` reads) that teaches a model to
    answer its inputs with what a decode generated, learning only the new tokens.
    tokens [batch, C] int32 and lengths [batch] int32 as `check_inputs` returns
    them; sequences [batch, N] int32 (0 after EOS) and sequence_lengths [batch]
    int32 from `generate`. Host numpy arrays in and out (distillation data)."""

  def teacher_features(self, config, params, batch: Mapping[str, Array], layers=None
                       ) -> Dict[str, Any]:
    """The target's teacher-forced features over a training batch: what a feature
    head's (or Medusa heads') loss reads, the target frozen (traced; one uncached
    forward pass). Families with `supports_features` implement it.

    Args:
      batch: the family's training batch (what `token_logits` reads).
      layers: the feature set, as `feature_dim` names it (None: the last layer's).
    Returns:
      dict(tokens: [batch, T] int32, the decoder's inputs at positions 0..T-1
             (the tokens a head reads, paired with the feature before each);
           features: [batch, T, f] float32, the target's features of each of
             those tokens (the state that produced the next token's law);
           weights: [batch, T] float32, 1 at the positions a loss learns;
           memory: None, or what the family's heads attend to besides their own
             keys, as `start_features` returns it (T5: the encoder outputs and
             mask)).
    """
    raise self._no_features()

  # -- Sharding --------------------------------------------------------------

  @abc.abstractmethod
  def param_logical_axes(self, path: Sequence[str], ndim: int) -> LogicalAxes:
    """Logical axis names of one parameter from its path in the tree."""

  @abc.abstractmethod
  def cache_logical_axes(self, cache) -> Any:
    """The cache tree with each leaf replaced by its logical axes."""

  @abc.abstractmethod
  def abstract_cache(self, config, batch: int, context_width: int,
                     max_decode_steps: int) -> Any:
    """ShapeDtypeStructs of the cache `start` builds (for the memory planner)."""

  # -- Checkpoints -----------------------------------------------------------

  architectures: Tuple[str, ...] = ()

  @abc.abstractmethod
  def detect(self, path: str) -> bool:
    """Whether `path` holds a checkpoint of this family."""

  @abc.abstractmethod
  def load(self, path: str, *, dtype: Optional[str] = None, place=None, **options):
    """A model from a checkpoint. `place(path_tuple, array) -> array` puts each
    tensor where it belongs (sharded loading) as it is read."""

  def export_hf(self, model, directory) -> None:
    """Writes `model` as a Hugging Face directory (config.json + model.safetensors)
    that transformers and `load` read back. A family without one says so."""
    raise NotImplementedError(f"the {self.name} family has no Hugging Face export")
