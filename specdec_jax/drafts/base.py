"""The draft interface: anything that proposes gamma tokens with their q.

Speculative decoding needs from a draft only (a) the proposed tokens and (b)
the distributions q they were drawn from, after the same sampling adjustment
as the target. Everything else (a cache, n-gram tables, the context) is the
draft's own state, carried through the decode loop as a pytree. A draft
reads the decode's inputs through the family's `Context` (families/base.py):
the T5 encoder tokens, or a decoder-only prompt that the generated tokens
continue.

A draft is split into static structure (the object, hashable via
`static_key`) and arrays (`params`, passed to the compiled loop as an
argument), so a new set of weights never triggers a recompile.
"""

import abc
from typing import Any, Hashable

import jax

from specdec_jax.families.base import Context

Array = jax.Array


class Draft(abc.ABC):
  """Base class for drafts used by `specdec_jax.generate(..., draft=...)`."""

  vocab_size: int
  eos_id: int = 1
  pad_id: int = 0
  # True for drafts that propose token trees (`TreeDraft`), decoded by
  # `core.tree_decoding` instead of the chain loop.
  proposes_trees: bool = False
  # True for drafts that read the target's hidden states (`FeatureDraft`): the
  # engine then starts and scores the target through its family's feature
  # callbacks (`Family.start_features`, `feature_block_fn`) with
  # `feature_layers`, calls `init_state(..., features=, memory=, gamma=,
  # start=)` with the decoder prompt's features [batch, P, f], the family's
  # memory and the `DecodeStart`, and hands the draft the features it may
  # see after each verification through `observe_fn`.
  wants_features: bool = False
  feature_layers = None
  # The deepest token tree whose levels this draft can score (None: any depth);
  # `TreeDraft` / `DynamicTreeDraft` refuse deeper ones (Medusa: one head a level).
  max_tree_depth = None

  def observe_fn(self, params: Any, gamma: int):
    """Feature drafts: `observe(state, features [batch, gamma + 1, f], tokens
    [batch, gamma + 1], count [batch]) -> state` (`decoding.speculative_sample`)."""
    raise TypeError(f"a {type(self).__name__} reads no target features")

  @property
  @abc.abstractmethod
  def params(self) -> Any:
    """Arrays the draft needs (a pytree), passed into the compiled loop."""

  @abc.abstractmethod
  def static_key(self) -> Hashable:
    """Hashable description of everything static: equal keys share a compile."""

  @abc.abstractmethod
  def init_state(self, params: Any, context: Context, max_decode_len: int) -> Any:
    """The draft's loop state for a batch (traced inside jit).

    context: the target family's view of the inputs (`Context`: tokens
      [batch, C], lengths [batch], whether generation continues them).
    max_decode_len: loop positions the decode runs for.
    """

  @abc.abstractmethod
  def propose_fn(self, params: Any, gamma: int, temperature: float, topk: int, topp: float):
    """Returns `propose(rng, state, sequences [batch, len + 1], lengths [batch],
    max_drafted=None) -> (draft_tokens [batch, gamma] int32, draft_probs [batch,
    gamma, vocab] float32, num_drafted [batch] int32, state)`; see
    `decoding.speculative_sample`.

    `max_drafted` ([batch] int32 in [1, gamma], or None for gamma) caps the
    tokens drafted per row (used by `AdaptiveGammaDraft`); `num_drafted` may be
    smaller still (0 means "no proposal": the iteration is a plain target
    step). For exactness, num_drafted may depend on the draft's own state and
    outputs, never on the target's distributions at this iteration; rows of
    draft_probs past num_drafted are ignored.
    """

  def tree_expander(self, params: Any, temperature: float, topk: int, topp: float):
    """How this draft scores the nodes of a token tree (`drafts.tree.TreeExpander`).

    Only drafts that give a distribution after any token path can grow a
    tree (`TreeDraft`): a model, an n-gram table. The default says this one
    cannot.
    """
    raise TypeError(f"a {type(self).__name__} gives no distribution at every tree node, so it "
                    "cannot grow a TreeDraft: use a ModelDraft or an NgramDraft")

  def check_inputs(self, tokens, lengths, max_decode_steps: int) -> None:
    """Raises ValueError if this draft cannot decode these inputs (host-side)."""

  def param_shardings(self, partitioner) -> Any:
    """Shardings of `params` on `partitioner`'s mesh (default: replicated)."""
    return jax.tree_util.tree_map(lambda _: partitioner.replicated(), self.params)

  def constrain_state(self, state: Any, partitioner) -> Any:
    """Inside jit under a mesh: pins the state's layout (default: left to GSPMD)."""
    return state

  def check_compatible(self, target_config) -> None:
    """Raises ValueError if this draft cannot serve the target."""
    if self.vocab_size != target_config.vocab_size:
      raise ValueError(f"draft vocabulary size {self.vocab_size} differs from the target's "
                       f"{target_config.vocab_size}: speculative decoding needs one vocabulary")
    for name in ("eos_id", "pad_id"):
      if getattr(self, name) != getattr(target_config, name):
        raise ValueError(f"draft {name} {getattr(self, name)} differs from the target's "
                         f"{getattr(target_config, name)}")
