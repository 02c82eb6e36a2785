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
