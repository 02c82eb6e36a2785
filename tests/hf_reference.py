"""transformers as the reference for decoder-only tests: greedy rows and how to compare them."""

import numpy as np


def hf_greedy(hf, prompts, lengths, steps, eos_id):
  """transformers' greedy `generate`, one row at a time (no padding conventions involved):
  each row's new tokens as a list (shorter than `steps` when it stopped at EOS)."""
  import torch
  rows = []
  for row, n in zip(prompts, lengths):
    with torch.no_grad():
      out = hf.generate(torch.tensor(row[None, :n], dtype=torch.long), do_sample=False,
                        max_new_tokens=steps, eos_token_id=eos_id, pad_token_id=0)
    rows.append(out[0, n:].numpy().tolist())
  return rows


def assert_matches_rows(sequences, rows):
  """Our sequences [batch, N] hold each reference row, then zeros."""
  sequences = np.asarray(sequences)
  for got, want in zip(sequences, rows):
    assert got[:len(want)].tolist() == want
    assert (got[len(want):] == 0).all()


def ragged_prompts(lengths, seed: int, vocab: int) -> np.ndarray:
  """[batch, max(lengths)] int32 prompts of random ids in [3, vocab), right-padded with 0."""
  rng = np.random.RandomState(seed)
  prompts = np.zeros((len(lengths), max(lengths)), np.int32)
  for b, n in enumerate(lengths):
    prompts[b, :n] = rng.randint(3, vocab, n)
  return prompts


def hf_logits(hf, tokens) -> np.ndarray:
  """transformers' logits [batch, len, vocab] of tokens, no padding mask (whole rows)."""
  import torch
  with torch.no_grad():
    return hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
