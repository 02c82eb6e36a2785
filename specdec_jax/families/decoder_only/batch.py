"""The decoder-only family's training batch: sequences and the tokens to learn.

  tokens:  [batch, T] int32, each row a sequence (prompt then continuation),
           right-padded;
  weights: [batch, T] float32, 1 where token t is a training target (predicted
           from tokens < t), 0 on padding and on prompt tokens not to be
           learned; weights[:, 0] is ignored (nothing predicts the first token).

`DecoderOnlyFamily.token_logits` reads it; distillation adds `teacher_probs`
[batch, T - 1, vocab] aligned with tokens 1..T-1.
"""

from typing import Dict

import numpy as np


def lm_batch(sequences, lengths, prompt_lengths=None) -> Dict[str, np.ndarray]:
  """A causal-LM batch from right-padded sequences [batch, T] and their lengths [batch].

  With `prompt_lengths` [batch], only the continuation (tokens at positions >=
  prompt_length) is learned; otherwise every token after the first.
  """
  tokens = np.asarray(sequences, np.int32)
  positions = np.arange(tokens.shape[1])[None]
  lengths = np.asarray(lengths)[:, None]
  start = 1 if prompt_lengths is None else np.maximum(np.asarray(prompt_lengths)[:, None], 1)
  weights = ((positions >= start) & (positions < lengths)).astype(np.float32)
  return dict(tokens=tokens, weights=weights)


def continuation_batch(tokens, lengths, sequences, sequence_lengths) -> Dict[str, np.ndarray]:
  """Rows prompt[:L] + new[:n] (right-padded to C + N), learning the new tokens.

  tokens [batch, C] and lengths L [batch]: the prompts; sequences [batch, N]
  and sequence_lengths n [batch]: what a decode generated after each prompt.
  """
  tokens = np.asarray(tokens, np.int32)
  lengths = np.asarray(lengths, np.int64)
  sequences = np.asarray(sequences, np.int32)
  new = np.asarray(sequence_lengths, np.int64)
  width, steps = tokens.shape[1], sequences.shape[1]
  rows = np.zeros((len(tokens), width + steps), np.int32)
  rows[:, :width] = np.where(np.arange(width)[None] < lengths[:, None], tokens, 0)
  # Each row's new tokens go right after its own prompt.
  keep = np.arange(steps)[None] < new[:, None]
  row, col = np.nonzero(keep)
  rows[row, lengths[row] + col] = sequences[row, col]
  return lm_batch(rows, lengths + new, lengths)
