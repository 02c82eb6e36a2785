"""Prompt lookup for decoder-only targets: draft by copying what followed the
context's last n-gram earlier in the same context.

A decoder-only row's context is its prompt followed by its generated tokens,
one sequence. Like HF's `prompt_lookup_num_tokens` (Saxena 2023), the last n
tokens of that context (which may reach back into the prompt) are looked for
earlier in it, and the tokens that followed the earliest match are proposed.
No network runs; q is one-hot on each drafted token, so the rejection rule
accepts x with probability p(x) and is exact at any temperature.

(`PromptLookupDraft` is the T5 version: there the input is the encoder's and
the n-gram is taken from the generated tokens only.)
"""

from typing import Any, Hashable, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.families.decoder_only.model import split_marked_prompts
from specdec_jax.drafts.base import Draft

Array = jax.Array


class DecoderOnlyPromptLookupDraft(Draft):
  """Proposes the continuation of the earliest earlier match of the context's last n-gram.

  For n = max_ngram down to min_ngram, the row's last n context tokens are
  looked for in its context (prompt, then generated tokens); the earliest
  match of the longest n wins. The proposal is the match's continuation, up
  to gamma tokens and never past the context's end, so `num_drafted` may be
  below gamma; with no match it is 0 (the iteration is a plain target step).

  State: the prompts as `decoder_only_generate` hands them to drafts
  ([batch, P], padding = PROMPT_PADDING).

  Args:
    vocab_size: the shared vocabulary size (for one-hot q).
    max_ngram / min_ngram: n-gram lengths tried, longest first (>= 1).
    eos_id / pad_id: the target's token conventions (checked, not used).
  """

  def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1,
               eos_id=None, pad_id: int = 0):
    if int(vocab_size) != vocab_size or vocab_size < 2:
      raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if int(min_ngram) != min_ngram or min_ngram < 1:
      raise ValueError(f"min_ngram must be an int >= 1, got {min_ngram!r}")
    if int(max_ngram) != max_ngram or max_ngram < min_ngram:
      raise ValueError(f"max_ngram must be an int >= min_ngram ({min_ngram}), got {max_ngram!r}")
    self.vocab_size = int(vocab_size)
    self.max_ngram = int(max_ngram)
    self.min_ngram = int(min_ngram)
    self.eos_id = eos_id
    self.pad_id = int(pad_id)

  @property
  def params(self) -> Any:
    return ()

  def static_key(self) -> Hashable:
    return ("decoder_only_prompt_lookup", self.vocab_size, self.max_ngram, self.min_ngram)

  def check_compatible(self, target_config) -> None:
    if self.vocab_size != target_config.vocab_size:
      raise ValueError(f"draft vocabulary size {self.vocab_size} differs from the target's "
                       f"{target_config.vocab_size}: speculative decoding needs one vocabulary")

  def init_state(self, params, encoder_tokens, max_decode_len):
    return jnp.asarray(encoder_tokens, jnp.int32)

  @staticmethod
  def context(marked_prompts: Array, sequences: Array, lengths: Array) -> Tuple[Array, Array]:
    """Each row's prompt and generated tokens as one left-aligned sequence.

    Args:
      marked_prompts: [batch, P], padding = PROMPT_PADDING.
      sequences: [batch, len + 1], the loop's: last prompt token, then generated.
      lengths: [batch] tokens generated.
    Returns:
      context [batch, P + len] int32 (0 past the end) and its length [batch].
    """
    prompts, prompt_lengths = split_marked_prompts(marked_prompts)
    generated = sequences[:, 1:]
    width = prompts.shape[1]
    i = jnp.arange(width + generated.shape[1])[None]
    # Position i is prompt token i before the prompt's end, else generated
    # token i - L, read from the concatenation [prompts, generated].
    source = jnp.where(i < prompt_lengths[:, None], i, width + i - prompt_lengths[:, None])
    source = jnp.clip(source, 0, width + generated.shape[1] - 1)
    context = jnp.take_along_axis(jnp.concatenate([prompts, generated], axis=1), source, axis=1)
    size = prompt_lengths + lengths
    return jnp.where(i < size[:, None], context, 0), size

  def continuation_start(self, context: Array, size: Array) -> Array:
    """[batch] index into `context` where the proposal starts, -1 when nothing matches."""
    total = context.shape[1]
    start = jnp.full(size.shape, -1, jnp.int32)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      if n >= total:
        continue
      suffix = jnp.take_along_axis(context, jnp.clip(size[:, None] - n + jnp.arange(n), 0,
                                                     total - 1), axis=1)
      # A window at j matches if its n tokens equal the suffix and its
      # continuation j + n lies inside the context (which excludes the suffix
      # itself, whose continuation is the context's end).
      windows = total - n
      match = jnp.arange(windows)[None] + n < size[:, None]
      for k in range(n):
        match = match & (context[:, k:k + windows] == suffix[:, k:k + 1])
      found = jnp.any(match, axis=1) & (size >= n) & (start < 0)
      start = jnp.where(found, jnp.argmax(match, axis=1) + n, start)
    return start

  def propose_fn(self, params, gamma, temperature, topk, topp):

    def propose(rng, marked_prompts, sequences, lengths, max_drafted=None):
      context, size = self.context(marked_prompts, sequences, lengths)
      start = self.continuation_start(context, size)
      index = jnp.maximum(start, 0)[:, None] + jnp.arange(gamma)
      num_drafted = jnp.where(start >= 0, jnp.clip(size - start, 0, gamma), 0).astype(jnp.int32)
      if max_drafted is not None:
        num_drafted = jnp.minimum(num_drafted, max_drafted)
      drafted = jnp.arange(gamma) < num_drafted[:, None]
      index = jnp.minimum(index, context.shape[1] - 1)
      tokens = jnp.where(drafted, jnp.take_along_axis(context, index, axis=1), 0)
      probs = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32) * drafted[..., None]
      return tokens, probs, num_drafted, marked_prompts

    return propose
