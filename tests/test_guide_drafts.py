"""docs/drafts.md's draft runs through every entry point the guide names (issue 55):
`sj.generate`, `sj.generate_many` and the launcher's slots, each code block as the guide
prints it; a draft that takes one key only (the guide's old `jax.random.split(rng, n)`)
is refused by name before anything compiles where row keys come (the slots), and still
serves `generate`."""

import json
import os
import re

import gin
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax import slots

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "drafts.md")


def _blocks():
  """The guide's three python blocks of 'A complete draft in one file': the draft, its
  use through generate and generate_many, the launcher."""
  text = open(DOCS).read()
  section = text[text.index("## A complete draft in one file"):]
  section = section[:section.index("It also works")]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 3, "the guide's draft, its use, the launcher"
  return blocks


def _single_key_draft(namespace):
  """The guide's draft as it was before: its keys split with jax.random.split."""
  code = _blocks()[0].replace("split_keys(rng, plan.gamma)", "jax.random.split(rng, plan.gamma)")
  assert "jax.random.split(rng, plan.gamma)" in code
  exec(compile(code, "old_accepted_counts.py", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["AcceptedCountsDraft"]


def test_the_guides_draft_runs_in_generate_and_generate_many_exactly():
  namespace = {}
  draft_code, use_code, _ = _blocks()
  exec(compile(draft_code + "\n" + use_code, "guide.py", "exec"), namespace)  # pylint: disable=exec-used
  out, many, pair = namespace["out"], namespace["many"], namespace["pair"]
  tokens, lengths = namespace["tokens"], namespace["lengths"]
  alone = sj.generate(pair.target, tokens, lengths, max_decode_steps=32)
  # Greedy: both equal target-only decoding, row for row.
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(alone.sequences))
  np.testing.assert_array_equal(np.asarray(many.sequences), np.asarray(alone.sequences))
  assert many.slots.batch_size == 2 and many.stats is not None


def test_the_guides_draft_runs_in_the_launchers_slots(tmp_path, monkeypatch):
  """The guide's launcher block, run from the repository root as printed, its two paths
  (the input file, the output directory) the user's own."""
  draft_code, _, launcher_code = _blocks()
  inputs, out = tmp_path / "prompts.jsonl", tmp_path / "counts_run"
  inputs.write_text("".join(
      json.dumps({"inputs": p}) + "\n" for p in ["def fib(n):", "import os", "x = 1 +"]))
  assert "'prompts.jsonl'" in launcher_code and '"counts_run"' in launcher_code
  launcher_code = launcher_code.replace("'prompts.jsonl'", repr(str(inputs))).replace(
      '"counts_run"', repr(str(out)))
  monkeypatch.chdir(os.path.dirname(DOCS) + "/..")
  namespace = {}
  try:
    exec(compile(draft_code + "\n" + launcher_code, "guide_launcher.py", "exec"), namespace)  # pylint: disable=exec-used
  finally:
    gin.clear_config()
  result = namespace["result"]
  assert result["scheduling"] == "slots" and result["identical_outputs"] is True
  assert (out / "results.md").exists()


def test_a_single_key_draft_is_refused_by_name_before_compiling(monkeypatch):
  pair = sj.load_demo_pair()
  tokens, lengths = pair.inputs(2)
  config = pair.target.config
  old = _single_key_draft({})(config.vocab_size, config.eos_id, config.pad_id)
  decoded = []
  monkeypatch.setattr(slots, "_decode_slots", lambda *a, **k: decoded.append(1))
  with pytest.raises(ValueError) as error:
    sj.generate_many(pair.target, tokens, lengths, batch_size=2, max_decode_steps=8,
                     draft=old, gamma=3)
  message = str(error.value)
  assert message.startswith("AcceptedCountsDraft's proposer cannot take one key per row: "
                            "sj.generate_many and the launcher's slots hand propose rng = "
                            "row keys, shape (batch, 2)"), message
  assert "Split rng with specdec_jax.core.sampling.split_keys(rng, n)" in message
  assert "given row keys of shape (2, 2), it raised" in message
  assert decoded == []  # Nothing ran.
  # generate hands one key: the same draft still serves it, exactly.
  out = sj.generate(pair.target, tokens, lengths, max_decode_steps=8, draft=old, gamma=3)
  alone = sj.generate(pair.target, tokens, lengths, max_decode_steps=8)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(alone.sequences))
