"""Prompt lookup: draft by copying what followed the last n-gram elsewhere.

Summaries, translations of names, code edits and plain copies repeat spans
of their input. Prompt lookup (Saxena 2023; HF `prompt_lookup_num_tokens`)
finds the row's last n generated tokens in the encoder input (or earlier in
its own output) and proposes the tokens that followed them. No network runs.

Proposals are deterministic, so q is one-hot on each drafted token; the
rejection rule then accepts x with probability p(x) and otherwise draws from
p with x removed: exact at any temperature.
"""

from typing import Any, Hashable

import jax
import jax.numpy as jnp

from specdec_jax.drafts.base import Draft

Array = jax.Array


class PromptLookupDraft(Draft):
  """Proposes the continuation of the longest matching recent n-gram.

  For n = max_ngram down to min_ngram, the row's last n generated tokens are
  looked for in the haystack [encoder input, separator, generated prefix];
  the first (earliest) match of the longest n wins, so the input is preferred
  to the row's own output, as in HF. The proposal is the match's continuation
  up to gamma tokens, stopping at the end of its segment (input padding or the
  row's length): `num_drafted` may be below gamma.

  Before any token is generated the n-gram is empty and the proposal is the
  start of the input (free, and right for copies).

  Fallback when nothing matches: `num_drafted` = 0, i.e. no proposal; the
  iteration is then an ordinary target step (the target still scores its
  gamma + 1 fixed-shape block, so a fixed guess would also be free, but it
  would blur the acceptance statistics for a gain of p(guess) tokens).

  Args:
    vocab_size: the shared vocabulary size (for one-hot q).
    max_ngram / min_ngram: n-gram lengths tried, longest first (>= 1).
    eos_id / pad_id: token conventions; pad_id marks input padding.
  """

  def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, eos_id: int = 1,
               pad_id: int = 0):
    if int(vocab_size) != vocab_size or vocab_size < 2:
      raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if int(min_ngram) != min_ngram or min_ngram < 1:
      raise ValueError(f"min_ngram must be an int >= 1, got {min_ngram!r}")
    if int(max_ngram) != max_ngram or max_ngram < min_ngram:
      raise ValueError(f"max_ngram must be an int >= min_ngram ({min_ngram}), got {max_ngram!r}")
    self.vocab_size = int(vocab_size)
    self.max_ngram = int(max_ngram)
    self.min_ngram = int(min_ngram)
    self.eos_id = int(eos_id)
    self.pad_id = int(pad_id)

  @property
  def params(self) -> Any:
    return ()

  def static_key(self) -> Hashable:
    return ("prompt_lookup", self.vocab_size, self.max_ngram, self.min_ngram, self.eos_id,
            self.pad_id)

  def init_state(self, params, encoder_tokens, max_decode_len):
    return jnp.asarray(encoder_tokens, jnp.int32)

  def continuation_start(self, encoder_tokens: Array, sequences: Array, lengths: Array):
    """Finds where each row's proposal starts.

    Args:
      encoder_tokens: [batch, enc_len] int32, pad_id-padded.
      sequences: [batch, len + 1] int32, BOS then generated tokens.
      lengths: [batch] int32, tokens generated.
    Returns:
      haystack [batch, enc_len + 1 + len] int32, valid [same] bool (real input
      or generated tokens), start [batch] int32 (index into the haystack, -1
      when nothing matches).
    """
    batch, enc_len = encoder_tokens.shape
    generated = sequences[:, 1:]
    max_len = generated.shape[1]
    haystack = jnp.concatenate(
        [encoder_tokens, jnp.zeros((batch, 1), jnp.int32), generated], axis=1)
    valid = jnp.concatenate([encoder_tokens != self.pad_id, jnp.zeros((batch, 1), jnp.bool_),
                             jnp.arange(max_len)[None] < lengths[:, None]], axis=1)
    size = haystack.shape[1]
    start = jnp.full((batch,), -1, jnp.int32)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      if n >= size:
        continue
      suffix = jnp.take_along_axis(
          generated, jnp.clip(lengths[:, None] - n + jnp.arange(n), 0, max_len - 1), axis=1)
      # A window at j matches if its n tokens equal the suffix and are all
      # real, and its continuation j + n is real (this excludes the suffix
      # itself, whose continuation lies at the row's length).
      match = valid[:, n:]
      for k in range(n):
        match = match & valid[:, k:size - n + k] & (haystack[:, k:size - n + k] == suffix[:, k:k + 1])
      found = jnp.any(match, axis=1) & (lengths >= n) & (start < 0)
      start = jnp.where(found, jnp.argmax(match, axis=1) + n, start)
    # Empty n-gram: nothing generated yet, propose the input's beginning.
    start = jnp.where((start < 0) & (lengths == 0) & valid[:, 0], 0, start)
    return haystack, valid, start

  def propose_fn(self, params, gamma, temperature, topk, topp):

    def propose(rng, encoder_tokens, sequences, lengths, max_drafted=None):
      haystack, valid, start = self.continuation_start(encoder_tokens, sequences, lengths)
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
      return tokens, probs, num_drafted, encoder_tokens

    return propose
