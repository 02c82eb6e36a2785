"""A smaller model of the target's family as the draft (the paper's setting).

The draft starts its own decode from the same context through its family
(`Family.start`: T5 encodes the encoder tokens with the draft's own encoder,
decoder-only prefills the prompt into the draft's cache) and drafts at the
same loop positions as the target, through the same block contract.
"""

from typing import Any, Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import decoding
from specdec_jax.drafts.base import Draft, chain_proposer
from specdec_jax.families.base import call_block, shift_block_fn
from specdec_jax.families.registry import family_of


class ModelDraft(Draft):
  """Drafts with a model of the target's family.

  Args:
    model: the draft model (`Model`, `DecoderOnlyModel`, or a model of any
      registered family), sharing the target's vocabulary.
    confidence_threshold: optional, in (0, 1]: a row stops drafting when the
      draft's top probability for the next position falls below it (HF's
      `assistant_confidence_threshold`, DISCO-style), so at most gamma and at
      least one token are drafted per iteration. The probability is read from
      the draft's own softmax (temperature 1, no truncation), not from the
      adjusted q: under greedy decoding q is one-hot and would never stop.
      Only the *top* probability is compared (not the drawn token's), so the
      stopping rule is a function of the prefix alone and exactness is kept.
    target_vocab_size: optional, >= the draft's vocabulary: the draft's
      logits are padded with -inf up to this size. For checkpoints around one
      tokenizer whose embedding tables were padded to different sizes
      (Qwen2.5 7B: 152064 rows, 0.5B: 151936): the draft then puts q = 0 on
      ids it lacks, which the rejection rule handles like any other q, so
      outputs stay exactly the target's.
  """

  def __init__(self, model, confidence_threshold: Optional[float] = None,
               target_vocab_size: Optional[int] = None):
    self.family = family_of(model)
    if not isinstance(model, self.family.model_type):
      raise TypeError(f"ModelDraft takes a model, got a {type(model).__name__}")
    if confidence_threshold is not None and not 0.0 < float(confidence_threshold) <= 1.0:
      raise ValueError(f"confidence_threshold must lie in (0, 1], got {confidence_threshold!r}")
    self.model = model
    self.confidence_threshold = (None if confidence_threshold is None else
                                 float(confidence_threshold))
    own = model.config.vocab_size
    if target_vocab_size is not None and (int(target_vocab_size) != target_vocab_size or
                                          target_vocab_size < own):
      raise ValueError(f"target_vocab_size must be an int >= the draft's vocabulary {own}, "
                       f"got {target_vocab_size!r}")
    self.padding = 0 if target_vocab_size is None else int(target_vocab_size) - own
    self.vocab_size = own + self.padding
    self.eos_id = model.config.eos_id
    self.pad_id = model.config.pad_id

  @property
  def params(self) -> Any:
    return self.model.params

  def static_key(self) -> Hashable:
    return ("model", self.model.config, self.confidence_threshold, self.padding)

  def check_compatible(self, target_config) -> None:
    target_family = family_of(target_config)
    if target_family is not self.family:
      raise ValueError(f"a {self.family.name} draft cannot serve a {target_family.name} target: "
                       "a model draft must be of the target's family (n-gram and prompt-lookup "
                       "drafts serve every family)")
    own, target_vocab = self.model.config.vocab_size, target_config.vocab_size
    if self.padding and target_vocab != self.vocab_size:
      raise ValueError(f"this draft's logits are padded to {self.vocab_size} ids, the target "
                       f"has {target_vocab}: pass target_vocab_size={target_vocab}")
    if not self.padding and own < target_vocab:
      # The common case of one tokenizer whose embedding tables were padded to different
      # sizes: the fix is one argument, so name it.
      raise ValueError(f"the draft's vocabulary size {own} is smaller than the target's "
                       f"{target_vocab}: if its ids are the target's first {own} (one "
                       "tokenizer, tables padded to different sizes), pass draft="
                       f"sj.ModelDraft(draft, target_vocab_size={target_vocab}), which gives "
                       "the missing ids probability 0 and keeps the outputs the target's")
    # Padded logits make the vocabularies equal; the family checks the rest.
    config = self.model.config
    self.family.check_draft(config.replace(vocab_size=self.vocab_size) if self.padding else
                            config, target_config)

  def check_inputs(self, tokens, lengths, max_decode_steps: int) -> None:
    """The draft's own limits on the inputs (e.g. its positions, its vocabulary)."""
    if lengths is None and self.family.context(None, None).continued:
      # Whether rows are padding is the target's check (its pad id); the draft reads the
      # rows the target accepted, full width.
      shape = np.shape(tokens)
      lengths = np.full(shape[:1], shape[1] if len(shape) == 2 else 1, np.int32)
    self.family.check_inputs(self.model.config, tokens, lengths, max_decode_steps)

  def param_shardings(self, partitioner):
    return partitioner.param_shardings(self.model.params, self.family)

  def constrain_state(self, state, partitioner):
    return dict(state, cache=partitioner.constrain_cache(state["cache"], self.family))

  def init_state(self, params, start):
    context = start.context
    decode = self.family.start(self.model.config, params, context.tokens, context.lengths,
                               start.max_decode_len)
    return dict(cache=decode.cache, offset=decode.offset)

  def block_fn(self, params):
    """The draft's block callback at absolute positions, logits padded to the target's vocabulary."""
    inner_block = self.family.block_fn(self.model.config, params)

    def block(tokens, positions, cache, tree=None):
      self.family.check_tree(tree)
      logits, cache = call_block(inner_block, tokens, positions, cache, tree)
      if self.padding:
        logits = jnp.pad(logits, ((0, 0), (0, 0), (0, self.padding)), constant_values=-jnp.inf)
      return logits, cache

    return block

  def proposer(self, params, plan):
    block = self.block_fn(params)
    sampling = plan.sampling

    def propose(rng, state, sequences, lengths, max_drafted=None):
      inner = decoding.model_propose_fn(shift_block_fn(block, state["offset"]), plan.gamma,
                                        sampling.temperature, sampling.topk, sampling.topp,
                                        confidence_threshold=self.confidence_threshold)
      tokens, probs, num_drafted, cache = inner(rng, state["cache"], sequences, lengths,
                                                max_drafted)
      return tokens, probs, num_drafted, dict(state, cache=cache)

    return chain_proposer(propose, plan)

  def tree_expander(self, params, sampling):
    """Scores tree nodes with the draft model (`drafts.tree_draft.TreeExpander`).

    `start` feeds the row's two last tokens (closing the gap a fully accepted
    leaf leaves, as `decoding.model_propose_fn` does) and the pending chain
    as one plain block; `expand` feeds one depth of the tree with its tree
    attention; `move` is the family's `move_cache`.
    """
    from specdec_jax.drafts.tree_draft import TreeExpander  # tree.py imports drafts
    block = self.block_fn(params)

    def laws(logits):
      scores = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      return scores, sampling.probs(logits)

    def start(state, sequences, lengths, chain, chain_len):
      rows = jnp.arange(sequences.shape[0])
      first = jnp.maximum(lengths - 1, 0)
      tokens = jnp.concatenate([sequences[rows, first][:, None],
                                sequences[rows, first + 1][:, None], chain], axis=1)
      logits, cache = block(tokens, first + state["offset"], state["cache"])
      scores, probs = laws(logits[rows, lengths - first + chain_len])
      return scores, probs, dict(state, cache=cache)

    def expand(state, lengths, chain_len, tokens, attention, block_offset):
      positions = lengths + chain_len + block_offset + state["offset"]
      logits, cache = block(tokens, positions, state["cache"], tree=attention)
      scores, probs = laws(logits)
      return scores, probs, dict(state, cache=cache)

    def move(state, lengths, sources):
      return dict(state, cache=self.family.move_cache(state["cache"], lengths + state["offset"],
                                                      sources))

    return TreeExpander(start, expand, move)
