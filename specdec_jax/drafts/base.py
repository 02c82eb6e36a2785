"""The proposer protocol: what every draft is to the engine.

A draft is anything that proposes tokens together with the laws q they were
drawn from, after the same sampling adjustment as the target's p. The engine
(`generate`, the T5X model, the launcher) knows a draft only through this
class, and asks it four things, in this order:

1. `reads`: what it needs from the target beside the decode's inputs
   (`Reads`): nothing; the target's hidden features at named layers; or the
   target's cache. The engine checks that the target's family can serve it,
   then starts and scores the target through the matching family callbacks.
2. `init_state(params, start)`: its loop state for a batch (traced), from a
   `DraftStart`: the inputs as the family's `Context`, the decode's length,
   the deepest proposal, and, for a draft that reads features, the target's
   features at the prompt.
3. `proposer(params, plan)`: how it proposes, for one `ProposalPlan`
   (sampling, gamma, block width): a `ChainProposer` (the chain loop,
   `core.decoding`) or a `TreeProposer` (the tree loop,
   `core.tree_decoding`). Each proposer runs its own loop, so the engine
   never asks which kind it holds. One call or several per proposal is the
   proposer's business; `calls_per_proposal` says which, for cost models.
   Its `rng` is one key (`generate`) or one key per row [batch, 2]
   (`generate_many`, the launcher's slots: an input's draws never depend on
   its batch): split it with `core.sampling.split_keys` and draw with
   `plan.sampling.draw`, which take either. For the slots `settings.check_draft`
   traces one proposal with row keys (`jax.eval_shape`, no compile) and refuses,
   by name, a draft that takes a single key only (`jax.random.split(rng, n)`).
4. after each verification, the proposer's `observe` (when it has one)
   learns the accepted count and tokens and, where `reads` asks for them,
   the target's features at accepted positions only: never anything the
   target computed at a rejected draft, so the next proposal is a function
   of accepted tokens (exactness).

A draft is split into static structure (the object, hashable through
`static_key`) and arrays (`params`, an argument of the compiled program), so
new weights never trigger a recompile. `docs/drafts.md` writes a new draft in
one file, outside the package.
"""

import abc
import dataclasses
from typing import Any, Hashable, NamedTuple, Optional

import jax

from specdec_jax.core import decoding
from specdec_jax.core.sampling import Sampling
from specdec_jax.families.base import Context, DecodeStart, Family

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Reads:
  """What a draft reads from the target beside the decode's inputs.

  features: the target's hidden features (`Family.start_features` /
    `feature_block_fn`); `layers` names them in the family's terms (None:
    the last hidden state after the final norm; a tuple of layer indices;
    "eagle3").
  cache: the target's cache, handed to `propose` as `target_cache=` (read
    only; the loop keeps its own).
  """
  features: bool = False
  layers: Any = None
  cache: bool = False

  def check_served(self, family: Family, config) -> None:
    """Raises ValueError naming the need when `family` cannot serve it for `config`."""
    if self.features:
      # The family names what it lacks (no features at all, or no such layer).
      family.feature_dim(config, self.layers)


NOTHING = Reads()


def target_features(layers: Any = None) -> Reads:
  """`Reads` for a draft over the target's hidden features at `layers`."""
  return Reads(features=True, layers=layers)


@dataclasses.dataclass(frozen=True)
class ProposalPlan:
  """The static settings one decode's proposer is built for.

  sampling: the adjustment shared with the target (q and p alike).
  gamma: a chain's most tokens per proposal; for a tree, its deepest node
    (`Draft.proposal_depth`).
  block_width: W, the width of every target call (a tree's slots fit in it).
  """
  sampling: Sampling
  gamma: int
  block_width: int


class DraftStart(NamedTuple):
  """What `Draft.init_state` receives (traced).

  context: the target family's view of the inputs (`Context`: tokens [batch,
    C], lengths [batch], whether generation continues them).
  max_decode_len: loop positions the decode runs for (tree room included).
  gamma: the deepest proposal (`ProposalPlan.gamma`).
  features: for drafts that read features, the target's features at the
    decoder prompt's slots [batch, P, f] (P = C for a continued context, 0
    for T5); None otherwise, and in shape queries.
  memory: what `Family.start_features` returned beside them (T5: encoder
    outputs), or None.
  decode: the target's `DecodeStart` (first inputs and offsets), or None in
    shape queries.
  """
  context: Context
  max_decode_len: int
  gamma: int
  features: Optional[Array] = None
  memory: Any = None
  decode: Optional[DecodeStart] = None


class Draft(abc.ABC):
  """Base class of every draft of `specdec_jax.generate(..., draft=...)`.

  Must define: `params`, `static_key`, `init_state`, `proposer`, and the
  attributes vocab_size / eos_id / pad_id (checked against the target's).
  May override: `reads`, `observer`, the checks, `proposal_depth` / `block_slots` /
  `room` (trees), `calls_per_proposal`, the sharding hooks, and
  `tree_expander` / `max_tree_depth` (what `TreeDraft` builds trees from).
  """

  vocab_size: int
  eos_id: int = 1
  pad_id: int = 0
  reads: Reads = NOTHING
  # The deepest token tree whose levels this draft can score (None: any depth);
  # `TreeDraft` / `DynamicTreeDraft` refuse deeper ones (Medusa: one head a level).
  max_tree_depth: Optional[int] = None

  # -- static structure ------------------------------------------------------

  @property
  @abc.abstractmethod
  def params(self) -> Any:
    """Arrays the draft needs (a pytree), passed into the compiled loop."""

  @abc.abstractmethod
  def static_key(self) -> Hashable:
    """Hashable description of everything static: equal keys share a compile."""

  def compile_key(self) -> Hashable:
    """What compiled-program caches key on: `static_key` and the draft's class, so a
    subclass that overrides a method (say `proposer`) never reuses its parent's program."""
    return (type(self), self.static_key())

  # -- the decode -------------------------------------------------------------

  @abc.abstractmethod
  def init_state(self, params: Any, start: DraftStart) -> Any:
    """The draft's loop state for a batch (traced inside jit)."""

  @abc.abstractmethod
  def proposer(self, params: Any, plan: ProposalPlan):
    """A `decoding.ChainProposer` or a `tree_decoding.TreeProposer` for `plan` (traced)."""

  def observer(self, params: Any):
    """None, or what the draft learns after each verification: `observe(state, features,
    tokens, count) -> state` (`decoding.ChainProposer`'s contract; features None unless
    `reads.features`). Chain proposers carry it, and `TreeDraft` hands it the accepted
    path, so a draft writes it once for both."""
    return None

  def proposal_depth(self, sampling: Sampling, gamma: int, block_width: int) -> int:
    """The deepest position one proposal reaches: gamma for a chain (a tree: its depth)."""
    return gamma

  def block_slots(self, gamma: int) -> int:
    """Target block slots one proposal fills: the row's last token and gamma drafts."""
    return gamma + 1

  def describe_slots(self, gamma: int) -> str:
    """How `block_slots` reads in an error message."""
    return f"gamma={gamma} needs target blocks of gamma + 1 = {gamma + 1} tokens"

  def room(self, block_width: int) -> int:
    """Positions past the decode that the draft's own state must hold (trees: > 0)."""
    return 0

  def target_room(self, block_width: int) -> int:
    """Positions past the decode that the target's cache must hold (0 for a chain; a
    tree writes block_width slots past a row's length whatever its depth)."""
    return 0

  def grown_params(self, small_target, large_config) -> Optional[Any]:
    """This draft's own arrays grown to drive `large_config`, a function-preserving
    embedding of `small_target` (`sj.scale_pair`; the large layout is [in, out]), or None
    when the draft reads nothing of the target's width (model drafts and tables drive the
    large target as they are). Raises `EmbeddingError` for arrays with no growing rule."""
    return None

  def with_grown_params(self, large_target, params) -> "Draft":
    """A draft of this kind over `large_target` with `grown_params`' arrays (in the large
    target's kernel layout and dtype)."""
    raise NotImplementedError(f"{type(self).__name__} has no grown arrays")

  @property
  def max_gamma(self) -> Optional[int]:
    """The longest chain one proposal can draft (None: any; Medusa: its heads). Tools that
    choose gamma (`tools.speedup`) stay below it."""
    return None

  def calls_per_proposal(self, gamma: int) -> int:
    """Draft calls per proposal: gamma for a drafter that feeds its own tokens back,
    1 for one that drafts a whole block at once (cost models read it)."""
    return gamma

  def tree_expander(self, params: Any, sampling: Sampling):
    """How this draft scores the nodes of a token tree (`drafts.tree_draft.TreeExpander`).

    Only drafts that give a distribution after any token path can grow a
    tree (`TreeDraft`): a model, an n-gram table, a feature head, Medusa
    heads. The default says this one cannot.
    """
    raise TypeError(f"a {type(self).__name__} gives no distribution at every tree node, so it "
                    "cannot grow a TreeDraft: use a ModelDraft or an NgramDraft")

  def tree_expander_for(self, params: Any, plan: ProposalPlan):
    """`tree_expander` for one decode's plan (what `TreeDraft` calls): the default passes
    the sampling; a draft whose expander needs more of the plan (a parallel drafter with
    a cache of its own: the block width) overrides this."""
    return self.tree_expander(params, plan.sampling)

  # -- host-side checks -------------------------------------------------------

  def check_verification(self, verification: str) -> None:
    """Raises ValueError if this draft's proposals cannot be verified by that rule."""

  def check_inputs(self, tokens, lengths, max_decode_steps: int) -> None:
    """Raises ValueError if this draft cannot decode these inputs."""

  def check_compatible(self, target_config) -> None:
    """Raises ValueError if this draft cannot serve the target."""
    if self.vocab_size != target_config.vocab_size:
      raise ValueError(f"draft vocabulary size {self.vocab_size} differs from the target's "
                       f"{target_config.vocab_size}: speculative decoding needs one vocabulary")
    for name in ("eos_id", "pad_id"):
      if getattr(self, name) != getattr(target_config, name):
        raise ValueError(f"draft {name} {getattr(self, name)} differs from the target's "
                         f"{getattr(target_config, name)}")

  # -- sharding ---------------------------------------------------------------

  def param_shardings(self, partitioner) -> Any:
    """Shardings of `params` on `partitioner`'s mesh (default: replicated)."""
    return jax.tree_util.tree_map(lambda _: partitioner.replicated(), self.params)

  def constrain_state(self, state: Any, partitioner) -> Any:
    """Inside jit under a mesh: pins the state's layout (default: left to GSPMD)."""
    return state


def chain_proposer(propose, plan: ProposalPlan, observe=None,
                   reads_cache: bool = False) -> decoding.ChainProposer:
  """A `ChainProposer` of gamma = plan.gamma (a convenience for chain drafts). `propose`
  takes rng as one key or one key per row (`core.sampling.split_keys` splits either)."""
  return decoding.ChainProposer(propose, plan.gamma, observe, reads_cache)
