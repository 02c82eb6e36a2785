"""Prompt lookup: draft by copying what followed the last n-gram elsewhere.

Summaries, translations of names, code edits and plain copies repeat spans
of their input. Prompt lookup (Saxena 2023; HF `prompt_lookup_num_tokens`)
finds the row's last n tokens earlier in its context and proposes the tokens
that followed them. No network runs, and one draft serves every family: it
reads the family's `Context`.

* Continued context (decoder-only): the prompt and the generated tokens are
  one sequence; its last n tokens (which may reach back into the prompt) are
  looked for earlier in it.
* Separate context (T5): the haystack is [encoder input, separator,
  generated tokens]; the n-gram is taken from the generated tokens, so the
  input is searched first, then the row's own output.

Proposals are deterministic, so q is one-hot on each drafted token; the
rejection rule then accepts x with probability p(x) and otherwise draws from
p with x removed: exact at any temperature.
"""

from typing import Any, Hashable, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.drafts.base import Draft, chain_proposer
from specdec_jax.families.base import Context

Array = jax.Array


class PromptLookupDraft(Draft):
  """Proposes the continuation of the longest matching recent n-gram.

  For n = max_ngram down to min_ngram, the row's last n tokens are looked for
  in its haystack (module docstring); the first (earliest) match of the
  longest n wins, as in HF. The proposal is the match's continuation up to
  gamma tokens, stopping at the end of its segment (the input's end, or the
  row's length): `num_drafted` may be below gamma.

  Before any token is generated from a separate context the n-gram is empty
  and the proposal is the start of the input (free, and right for copies).

  Fallback when nothing matches: `num_drafted` = 0, i.e. no proposal; the
  iteration is then an ordinary target step (the target still scores its
  fixed-shape block, so a fixed guess would also be free, but it would blur
  the acceptance statistics for a gain of p(guess) tokens).

  Args:
    vocab_size: the shared vocabulary size (for one-hot q).
    max_ngram / min_ngram: n-gram lengths tried, longest first (>= 1).
  """

  def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
    if int(vocab_size) != vocab_size or vocab_size < 2:
      raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if int(min_ngram) != min_ngram or min_ngram < 1:
      raise ValueError(f"min_ngram must be an int >= 1, got {min_ngram!r}")
    if int(max_ngram) != max_ngram or max_ngram < min_ngram:
      raise ValueError(f"max_ngram must be an int >= min_ngram ({min_ngram}), got {max_ngram!r}")
    self.vocab_size = int(vocab_size)
    self.max_ngram = int(max_ngram)
    self.min_ngram = int(min_ngram)

  @property
  def params(self) -> Any:
    return ()

  def static_key(self) -> Hashable:
    return ("prompt_lookup", self.vocab_size, self.max_ngram, self.min_ngram)

  def check_compatible(self, target_config) -> None:
    # Token conventions do not matter: the context's lengths mark its padding.
    if self.vocab_size != target_config.vocab_size:
      raise ValueError(f"draft vocabulary size {self.vocab_size} differs from the target's "
                       f"{target_config.vocab_size}: speculative decoding needs one vocabulary")

  def init_state(self, params, start):
    return start.context

  @staticmethod
  def haystack(context: Context, sequences: Array, lengths: Array
               ) -> Tuple[Array, Array, Array, Array]:
    """Each row's searchable tokens and where its n-gram ends.

    Args:
      context: the family's `Context` (tokens [batch, C], lengths [batch]).
      sequences: [batch, len + 1] int32, the loop's first input then the
        generated tokens.
      lengths: [batch] int32, tokens generated.
    Returns:
      haystack [batch, H] int32; valid [batch, H] bool (real tokens); end
      [batch] int32 (the n-gram is haystack[end - n:end]); available [batch]
      int32 (tokens the n-gram may use).
    """
    generated = sequences[:, 1:]
    batch, width = context.tokens.shape
    max_len = generated.shape[1]
    if context.continued:
      # One left-aligned sequence: position i is context token i before the
      # context's end, else generated token i - L.
      i = jnp.arange(width + max_len)[None]
      size = context.lengths + lengths
      source = jnp.where(i < context.lengths[:, None], i, width + i - context.lengths[:, None])
      source = jnp.clip(source, 0, width + max_len - 1)
      haystack = jnp.take_along_axis(jnp.concatenate([context.tokens, generated], axis=1),
                                     source, axis=1)
      valid = i < size[:, None]
      return jnp.where(valid, haystack, 0), valid, size, size
    haystack = jnp.concatenate([context.tokens, jnp.zeros((batch, 1), jnp.int32), generated],
                               axis=1)
    valid = jnp.concatenate([context.mask(), jnp.zeros((batch, 1), jnp.bool_),
                             jnp.arange(max_len)[None] < lengths[:, None]], axis=1)
    return haystack, valid, width + 1 + lengths, lengths

  def continuation_start(self, haystack: Array, valid: Array, end: Array, available: Array
                         ) -> Array:
    """[batch] index into the haystack where the proposal starts, -1 when nothing matches."""
    size = haystack.shape[1]
    start = jnp.full(end.shape, -1, jnp.int32)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      if n >= size:
        continue
      suffix = jnp.take_along_axis(haystack, jnp.clip(end[:, None] - n + jnp.arange(n), 0,
                                                      size - 1), axis=1)
      # A window at j matches if its n tokens equal the suffix and are all
      # real, and its continuation j + n is real (this excludes the suffix
      # itself, whose continuation lies at the row's end).
      match = valid[:, n:]
      for k in range(n):
        match = match & valid[:, k:size - n + k] & (haystack[:, k:size - n + k] ==
                                                    suffix[:, k:k + 1])
      found = jnp.any(match, axis=1) & (available >= n) & (start < 0)
      start = jnp.where(found, jnp.argmax(match, axis=1) + n, start)
    # Empty n-gram (nothing generated after a separate context): propose the
    # input's beginning.
    return jnp.where((start < 0) & (available == 0) & valid[:, 0], 0, start)

  def proposer(self, params, plan):
    gamma = plan.gamma

    def propose(rng, context, sequences, lengths, max_drafted=None):
      haystack, valid, end, available = self.haystack(context, sequences, lengths)
      start = self.continuation_start(haystack, valid, end, available)
      size = haystack.shape[1]
      index = jnp.maximum(start, 0)[:, None] + jnp.arange(gamma)
      inside = index < size
      index = jnp.minimum(index, size - 1)
      real = jnp.take_along_axis(valid, index, axis=1) & inside
      num_drafted = jnp.sum(jnp.cumprod(real, axis=1), axis=1).astype(jnp.int32)
      num_drafted = jnp.where(start >= 0, num_drafted, 0)
      if max_drafted is not None:
        num_drafted = jnp.minimum(num_drafted, max_drafted)
      drafted = jnp.arange(gamma) < num_drafted[:, None]
      tokens = jnp.where(drafted, jnp.take_along_axis(haystack, index, axis=1), 0)
      probs = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32) * drafted[..., None]
      return tokens, probs, num_drafted, context

    return chain_proposer(propose, plan)

  def calls_per_proposal(self, gamma: int) -> int:
    return 0  # a lookup in the context, no network
