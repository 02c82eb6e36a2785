"""Unigram and bigram drafts (the paper's Table 3 baselines).

The draft proposes gamma tokens by sampling from a count-based model of the
next token: order 1 ignores the prefix; order 2 conditions on the previous
token (the decoder start token, `pad_id`, before the first output token).

Estimates, with `smoothing` = s >= 0 pseudo-counts per vocabulary entry:
  unigram  u(x)     = (c(x) + s) / (N + s V)
  bigram   q(x | a) = (c(a, x) + s V u(x)) / (c(a) + s V)
i.e. additive smoothing whose prior is uniform for the unigram and the
unigram for the bigram; a context never seen (c(a) = 0) falls back to u.
With s = 0 these are maximum-likelihood estimates, zeros included (zeros in q
are harmless for exactness: such tokens are never drafted).

Memory: the bigram keeps, for each previous token, the `max_continuations`
most frequent next tokens (ties to lower ids) and their counts: O(V K) instead
of O(V^2), which matters at T5's V = 32128. Dropped continuations only lose
their share of the bigram (they keep the smoothed unigram share); q remains a
distribution, so exactness is unaffected. With K >= the number of distinct
continuations (always when K >= V) the counts are complete.
"""

import io
import os
from typing import Any, Hashable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import results
from specdec_jax.core import sampling
from specdec_jax.drafts.base import Draft, chain_proposer

Array = jax.Array


def _corpus_sequences(sequences, vocab_size: int, eos_id: int, pad_id: int):
  """Validates a corpus and yields 1-D int64 arrays of output tokens.

  Each sequence is cut after its first EOS and stripped of trailing pad_id
  (T5X decodes and 0-padded target arrays hold pad after the end).
  """
  if isinstance(sequences, (np.ndarray, jax.Array)):
    array = np.asarray(sequences)
    if array.ndim != 2:
      raise ValueError(f"a token corpus array must be [num_sequences, length], got shape "
                       f"{array.shape}")
    sequences = list(array)
  out = []
  for i, seq in enumerate(sequences):
    seq = np.asarray(seq)
    if seq.ndim != 1:
      raise ValueError(f"corpus sequence {i} must be 1-D, got shape {seq.shape}")
    if seq.size and not np.issubdtype(seq.dtype, np.integer):
      raise ValueError(f"corpus sequence {i} must hold integer token ids, got dtype {seq.dtype}")
    seq = seq.astype(np.int64)
    bad = (seq < 0) | (seq >= vocab_size)
    if bad.any():
      j = int(np.argmax(bad))
      raise ValueError(f"corpus sequence {i} holds token {int(seq[j])} at position {j}, outside "
                       f"the vocabulary [0, {vocab_size})")
    eos = np.flatnonzero(seq == eos_id)
    if eos.size:
      seq = seq[:eos[0] + 1]
    else:
      nonpad = np.flatnonzero(seq != pad_id)
      seq = seq[:nonpad[-1] + 1] if nonpad.size else seq[:0]
    out.append(seq)
  return out


class NgramDraft(Draft):
  """A unigram (order 1) or bigram (order 2) draft from token counts.

  Build it with `NgramDraft.fit(corpus, vocab_size, order=...)`,
  `distill.ngram_from_target_samples(model, encoder_tokens, ...)` (fit on the
  target's own outputs) or `NgramDraft.load(path)`; the constructor takes the
  count arrays.

  Args:
    unigram_counts: [vocab] int, c(x).
    bigram_tokens: [vocab, K] int, the K kept next tokens after each token
      (order 2 only; slots with count 0 are empty).
    bigram_counts: [vocab, K] int, c(a, x) for those tokens.
    smoothing: s >= 0 pseudo-counts per vocabulary entry (module docstring).
    eos_id / pad_id: the token conventions (pad_id also starts the decoder).
  """

  def __init__(self, unigram_counts, bigram_tokens=None, bigram_counts=None,
               smoothing: float = 0.0, eos_id: int = 1, pad_id: int = 0):
    unigram_counts = np.asarray(unigram_counts)
    if unigram_counts.ndim != 1 or unigram_counts.size < 2:
      raise ValueError(f"unigram_counts must be [vocab] with vocab >= 2, got shape "
                       f"{unigram_counts.shape}")
    if not float(smoothing) >= 0.0:
      raise ValueError(f"smoothing must be >= 0, got {smoothing!r}")
    if (unigram_counts < 0).any():
      raise ValueError("unigram_counts must be non-negative")
    vocab = unigram_counts.size
    if unigram_counts.sum() == 0 and smoothing == 0:
      raise ValueError("the corpus is empty and smoothing is 0: the unigram is undefined")
    if (bigram_tokens is None) != (bigram_counts is None):
      raise ValueError("bigram_tokens and bigram_counts go together")
    if bigram_tokens is not None:
      bigram_tokens = np.asarray(bigram_tokens)
      bigram_counts = np.asarray(bigram_counts)
      if bigram_tokens.ndim != 2 or bigram_tokens.shape[0] != vocab or (
          bigram_counts.shape != bigram_tokens.shape):
        raise ValueError(f"bigram_tokens and bigram_counts must both be [vocab={vocab}, K], got "
                         f"{bigram_tokens.shape} and {bigram_counts.shape}")
      if ((bigram_tokens < 0) | (bigram_tokens >= vocab)).any() or (bigram_counts < 0).any():
        raise ValueError(f"bigram_tokens must lie in [0, {vocab}) and bigram_counts be >= 0")
      bigram_tokens = bigram_tokens.astype(np.int32)
      bigram_counts = bigram_counts.astype(np.int64)
    self.unigram_counts = unigram_counts.astype(np.int64)
    self.bigram_tokens = bigram_tokens
    self.bigram_counts = bigram_counts
    self.smoothing = float(smoothing)
    self.vocab_size = vocab
    self.order = 1 if bigram_tokens is None else 2
    self.eos_id = int(eos_id)
    self.pad_id = int(pad_id)
    self._params = self._tables()

  # -- Estimation ------------------------------------------------------------

  @classmethod
  def fit(cls, sequences: Iterable, vocab_size: int, order: int = 2, smoothing: float = 0.0,
          max_continuations: int = 64, eos_id: int = 1, pad_id: int = 0) -> "NgramDraft":
    """Counts a token corpus.

    Args:
      sequences: decoder output token sequences (no BOS): a list of 1-D int
        sequences or a [num, length] array; each is cut after its first EOS
        and stripped of trailing pad_id.
      vocab_size: V; a token outside [0, V) is an error.
      order: 1 (unigram) or 2 (bigram; the first token's context is pad_id).
      smoothing: pseudo-counts per vocabulary entry (module docstring).
      max_continuations: K, next tokens kept per previous token (order 2).
      eos_id / pad_id: token conventions.
    """
    if order not in (1, 2):
      raise ValueError(f"order must be 1 (unigram) or 2 (bigram), got {order!r}")
    if int(vocab_size) != vocab_size or vocab_size < 2:
      raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if int(max_continuations) != max_continuations or max_continuations < 1:
      raise ValueError(f"max_continuations must be an int >= 1, got {max_continuations!r}")
    vocab = int(vocab_size)
    seqs = _corpus_sequences(sequences, vocab, eos_id, pad_id)
    tokens = np.concatenate(seqs) if seqs else np.zeros((0,), np.int64)
    unigram = np.bincount(tokens, minlength=vocab)
    if order == 1:
      return cls(unigram, smoothing=smoothing, eos_id=eos_id, pad_id=pad_id)
    prev = np.concatenate([np.concatenate([[pad_id], s[:-1]]) for s in seqs if s.size] or
                          [np.zeros((0,), np.int64)])
    pairs, counts = np.unique(prev * vocab + tokens, return_counts=True)
    first, second = pairs // vocab, pairs % vocab
    # Most frequent continuations first within each context, ties to lower ids.
    order_ = np.lexsort((second, -counts, first))
    first, second, counts = first[order_], second[order_], counts[order_]
    group_start = np.searchsorted(first, first, side="left")
    rank = np.arange(first.size) - group_start
    keep = rank < max_continuations
    width = min(int(max_continuations), vocab)
    bigram_tokens = np.zeros((vocab, width), np.int32)
    bigram_counts = np.zeros((vocab, width), np.int64)
    bigram_tokens[first[keep], rank[keep]] = second[keep]
    bigram_counts[first[keep], rank[keep]] = counts[keep]
    return cls(unigram, bigram_tokens, bigram_counts, smoothing=smoothing, eos_id=eos_id,
               pad_id=pad_id)

  def dense_bigram_counts(self) -> np.ndarray:
    """[vocab, vocab] int64 c(a, x) as kept (for inspection at small vocabularies)."""
    if self.order != 2:
      raise ValueError("a unigram draft has no bigram counts")
    dense = np.zeros((self.vocab_size, self.vocab_size), np.int64)
    rows = np.repeat(np.arange(self.vocab_size), self.bigram_tokens.shape[1])
    np.add.at(dense, (rows, self.bigram_tokens.ravel()), self.bigram_counts.ravel())
    return dense

  def _tables(self):
    """Probability tables (float32) the compiled proposer reads."""
    vocab, s = self.vocab_size, self.smoothing
    counts = self.unigram_counts.astype(np.float64)
    unigram = (counts + s) / (counts.sum() + s * vocab)
    tables = dict(unigram=jnp.asarray(unigram, jnp.float32))
    if self.order == 2:
      context = self.bigram_counts.sum(axis=1).astype(np.float64)
      denom = context + s * vocab
      # Unseen contexts (denominator 0) fall back to the unigram entirely.
      backoff = np.where(denom > 0, s * vocab / np.where(denom > 0, denom, 1.0), 1.0)
      weights = self.bigram_counts / np.where(denom > 0, denom, 1.0)[:, None]
      tables.update(backoff=jnp.asarray(backoff, jnp.float32),
                    next_tokens=jnp.asarray(self.bigram_tokens, jnp.int32),
                    next_weights=jnp.asarray(weights, jnp.float32))
    return tables

  def probs(self, params, previous: Array) -> Array:
    """The unadjusted next-token distribution [batch, vocab] given previous [batch] tokens."""
    batch = previous.shape[0]
    unigram = jnp.broadcast_to(params["unigram"], (batch, self.vocab_size))
    if self.order == 1:
      return unigram
    dense = jnp.zeros((batch, self.vocab_size), jnp.float32).at[
        jnp.arange(batch)[:, None], params["next_tokens"][previous]].add(
            params["next_weights"][previous])
    return params["backoff"][previous][:, None] * unigram + dense

  # -- Saving ----------------------------------------------------------------

  def save(self, path) -> None:
    """Writes the counts and settings to an .npz file, atomically."""
    arrays = dict(unigram_counts=self.unigram_counts, smoothing=np.float64(self.smoothing),
                  eos_id=np.int64(self.eos_id), pad_id=np.int64(self.pad_id),
                  order=np.int64(self.order))
    if self.order == 2:
      arrays.update(bigram_tokens=self.bigram_tokens, bigram_counts=self.bigram_counts)
    path = os.fspath(path)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    results.write_bytes_atomic(path, buffer.getvalue())

  @classmethod
  def load(cls, path) -> "NgramDraft":
    """Reads a draft written by `save`."""
    with np.load(os.fspath(path)) as data:
      missing = {"unigram_counts", "smoothing", "eos_id", "pad_id", "order"} - set(data.files)
      if missing:
        raise ValueError(f"{path} is not an NgramDraft file: missing {sorted(missing)}")
      order = int(data["order"])
      if order == 2 and not {"bigram_tokens", "bigram_counts"} <= set(data.files):
        raise ValueError(f"{path} says order 2 but holds no bigram arrays")
      return cls(data["unigram_counts"],
                 data["bigram_tokens"] if order == 2 else None,
                 data["bigram_counts"] if order == 2 else None,
                 smoothing=float(data["smoothing"]), eos_id=int(data["eos_id"]),
                 pad_id=int(data["pad_id"]))

  # -- Draft interface -------------------------------------------------------

  @property
  def params(self) -> Any:
    return self._params

  def static_key(self) -> Hashable:
    width = 0 if self.order == 1 else self.bigram_tokens.shape[1]
    return ("ngram", self.vocab_size, self.order, width, self.eos_id, self.pad_id)

  def init_state(self, params, start):
    # The previous token is read from the sequences: no state to carry.
    return ()

  def proposer(self, params, plan):
    gamma, settings = plan.gamma, plan.sampling

    def propose(rng, state, sequences, lengths, max_drafted=None):
      batch = sequences.shape[0]
      previous = sequences[jnp.arange(batch), lengths]

      def step(previous, step_rng):
        probs = settings.probs(sampling.safe_log(self.probs(params, previous)))
        token = sampling.sample(step_rng, probs)
        return token, (token, probs)

      _, (tokens, probs) = jax.lax.scan(step, previous, sampling.split_keys(rng, gamma))
      num_drafted = (jnp.full((batch,), gamma, jnp.int32) if max_drafted is None else
                     jnp.clip(max_drafted, 1, gamma).astype(jnp.int32))
      return jnp.moveaxis(tokens, 0, 1), jnp.moveaxis(probs, 0, 1), num_drafted, state

    return chain_proposer(propose, plan)

  def calls_per_proposal(self, gamma: int) -> int:
    return 0  # table lookups, no network

  def tree_expander(self, params, settings):
    """Scores tree nodes from the counts: a node's law depends on its own token only."""
    from specdec_jax.drafts.tree_draft import TreeExpander  # tree.py imports drafts

    def laws(previous):
      scores = sampling.safe_log(self.probs(params, previous))
      return scores, settings.probs(scores)

    def start(state, sequences, lengths, chain, chain_len):
      rows = jnp.arange(sequences.shape[0])
      previous = jnp.where(chain_len > 0, chain[rows, jnp.maximum(chain_len - 1, 0)],
                           sequences[rows, lengths])
      return (*laws(previous), state)

    def expand(state, lengths, chain_len, tokens, attention, block_offset):
      scores, probs = laws(tokens.reshape(-1))
      shape = tokens.shape + (self.vocab_size,)
      return scores.reshape(shape), probs.reshape(shape), state

    return TreeExpander(start, expand, lambda state, lengths, sources: state)
