"""Scoring a sequence through a decoder-only cache the way speculative decoding does."""

import numpy as np


def score_in_ragged_blocks(model, tokens, prompt_lengths, block_sizes, rng, vocab):
  """Prefills ragged prompts, then scores the rest in blocks at per-row positions.

  Each row keeps only the first `advance` of its k block tokens; the rest is a
  rejected draft (junk tokens) whose cache entries must not matter. Rows
  already past the end score junk at position 0 and stay put.

  Args:
    tokens: [batch, length] int32; row b's prompt is tokens[b, :prompt_lengths[b]].
    block_sizes: the k drawn from per step (each a compile).
  Returns:
    (the prefill's logits [batch, vocab] at each prompt's last token, logits
    [batch, length, vocab] at every position scored, NaN before the prompt's end).
  """
  batch, length = tokens.shape
  width, k_max = int(prompt_lengths.max()), max(block_sizes)
  prompts = np.where(np.arange(width)[None] < prompt_lengths[:, None], tokens[:, :width], 0)
  cache = model.init_cache(batch, length + k_max)
  last, cache = model.prefill(prompts.astype(np.int32), prompt_lengths, cache)
  positions = prompt_lengths.copy()
  got = np.full((batch, length, last.shape[-1]), np.nan, np.float32)
  padded = np.pad(tokens, ((0, 0), (0, k_max)))
  while positions.min() < length:
    k = block_sizes[rng.randint(len(block_sizes))]
    advance = rng.randint(1, k + 1, batch)
    block = np.stack([padded[b, p:p + k] for b, p in enumerate(np.minimum(positions, length))])
    junk = rng.randint(3, vocab, block.shape)
    block = np.where(np.arange(k)[None] < advance[:, None], block, junk).astype(np.int32)
    done = positions >= length
    logits, cache = model.decode_block(block, np.where(done, 0, positions), cache)
    for b in np.flatnonzero(~done):
      for j in range(advance[b]):
        if positions[b] + j < length:
          got[b, positions[b] + j] = logits[b, j]
    positions = np.where(done, positions, positions + advance)
  return np.asarray(last), got
