r"""Writes the demo pairs' mini-benchmarks: Spec-Bench `question.jsonl` files of held-out code.

One file per shipped pair, `demo_pair/benchmark.jsonl` (T5) and
`demo_pair_decoder_only/benchmark.jsonl` (decoder-only), one JSON object a line,
`{"question_id": int, "category": str, "turns": [str, ...]}`, built only from
the stdlib files both pairs held out of training (`data.split_files`, the
trainers' own split) and sized to each pair's positions with its tokenizer.
Five categories, each a different regime for drafts:

  completion         a code prefix to continue (the pairs' own task), picked
                     where the reference continuation copies little of it;
  docstring_to_code  a function's `def` line and docstring, the body to write;
  editing            repetition-heavy code (near-identical calls, tables, lists)
                     whose reference continuation copies >= 85% of its 3-grams
                     from the prompt: the regime for copying drafts (prompt
                     lookup), as far as these weak targets copy at all (the
                     cards' "Mini-benchmark" sections);
  long_context       the longest code prefixes the pair takes (T5: 256-384
                     encoder tokens; decoder-only: 72-80 prompt tokens);
  multi_turn         2 turns: a code prefix, then the lines of the same file
                     after its reference continuation (the harness feeds turn
                     1, the answer, turn 2 as text joined by newlines).

Every turn is whole lines ending in a newline (the form the pairs were trained
on). The output is a pure function of the stdlib source, the tokenizer and
--seed: rerunning it reproduces the shipped files byte for byte.

  python scripts/make_demo_benchmark.py [--out_root=DIR] [--seed=0]
  python scripts/make_demo_benchmark.py --measure [--per_category=6]

--measure writes nothing: it decodes each category's first turns at batch 1,
greedy, gamma 4, with the model draft, prompt lookup and the bigram, and
prints tau (emitted / iterations) and alpha per category as a markdown table.
"""

import argparse
import ast
import dataclasses
import json
import os
import sys
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # Run as a file, the repository's package is importable too.
  sys.path.insert(0, _REPO)

from specdec_jax import data  # noqa: E402

BENCHMARK_FILE = "benchmark.jsonl"
CATEGORIES = ("completion", "docstring_to_code", "editing", "long_context", "multi_turn")
PER_CATEGORY = 6
# The trainers' split (experiments/train_demo_pair.py, train_decoder_only_pair.py).
HELDOUT_PERCENT = 5
TOKENIZER = os.path.join(_REPO, "demo_pair", "tokenizer.model")  # shared by both pairs


@dataclasses.dataclass(frozen=True)
class PairBudget:
  """The token budgets one pair's questions are cut to (counted with its tokenizer).

  name: the pair's family ('t5' or 'decoder_only'); out_dir: its directory.
  prompt_range: (min, max) tokens of a single-turn prompt (completion, editing;
    docstring_to_code only the max).
  long_range: (min, max) tokens of a long_context prompt.
  answer_tokens: the most tokens an answer has (the pair's max_decode_steps).
  positions: decoder-only: the model's positions, which the longest prompt
    plus the answer must fit; None for T5 (relative positions).
  multi_turn_total: the most tokens turn 1 + turn 2 may have together (with
    the earlier answer and the new one they must fit `positions`).
  multi_turn_first: (min, max) tokens of turn 1.
  """
  name: str
  out_dir: str
  prompt_range: Tuple[int, int]
  long_range: Tuple[int, int]
  answer_tokens: int
  positions: Optional[int]
  multi_turn_total: int
  multi_turn_first: Tuple[int, int]


# T5: encoder inputs of the trained width (64 = 63 ids + EOS) except long_context; a
# multi-turn prompt is turn 1 + answer (<= 40 tokens) + turn 2: at most 126 + 42 + EOS.
# Decoder-only: prompt + 48 new tokens <= 128 positions, so a prompt is <= 80 tokens, and a
# second turn's prompt (turn 1, a 48-token answer, turn 2, two joining newlines) leaves
# turn 1 + turn 2 <= 128 - 48 - 48 - 2 = 30, less 2 tokens of slack for re-encoding the
# answer's text: turns of a line or two.
BUDGETS = {
    "t5": PairBudget("t5", "demo_pair", prompt_range=(32, 63), long_range=(256, 384),
                     answer_tokens=40, positions=None, multi_turn_total=126,
                     multi_turn_first=(32, 63)),
    "decoder_only": PairBudget("decoder_only", "demo_pair_decoder_only", prompt_range=(32, 64),
                               long_range=(72, 80), answer_tokens=48, positions=128,
                               multi_turn_total=28, multi_turn_first=(12, 18)),
}
JOIN_TOKENS = 2  # the newlines the harness puts between turn 1, its answer and turn 2
RE_ENCODE_SLACK = 2


def prompt_tokens(tokenizer, text: str) -> int:
  """Tokens of `text` as a harness may encode it: whole (`encode`) or line by line (the
  trainers' `encode_lines`), whichever is longer."""
  return max(len(tokenizer.encode(text)), len(tokenizer.encode_lines(text)))


def longest_prompt(budget: PairBudget, tokenizer, turns: Sequence[str]) -> int:
  """The most tokens the pair reads for a question: its last turn's prompt, with every
  earlier turn, an answer of `answer_tokens` after each and the joining newlines."""
  earlier = len(turns) - 1
  return (sum(prompt_tokens(tokenizer, t) for t in turns)
          + earlier * (budget.answer_tokens + JOIN_TOKENS))


def fits(budget: PairBudget, tokenizer, turns: Sequence[str]) -> bool:
  """Whether the question's longest prompt and its answer fit the pair's positions."""
  if budget.positions is None:
    return True
  return (longest_prompt(budget, tokenizer, turns) + RE_ENCODE_SLACK + budget.answer_tokens
          <= budget.positions)


# ----------------------------------------------------------------------------
# Candidates: (path, line, turns, score) from each held-out file
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Candidate:
  """One possible question: where it comes from, its turns, and how much its reference
  continuation copies its input (`copy_fraction`)."""
  path: str
  line: int
  turns: Tuple[str, ...]
  copied: float


def clean(text: str) -> bool:
  """Printable code only: no form feeds or other controls that `splitlines` splits on."""
  return all(c.isprintable() or c in "\n\t" for c in text)


def copy_fraction(prompt_ids: Sequence[int], continuation_ids: Sequence[int],
                  n: int = 3) -> float:
  """The share of continuation tokens whose n-gram (ending at them) occurred earlier in
  prompt + continuation: what an oracle prompt lookup of n-grams would get right."""
  seq = list(prompt_ids) + list(continuation_ids)
  seen = {tuple(seq[k:k + n]) for k in range(len(prompt_ids) - n + 1)}
  hits = 0
  for j in range(len(prompt_ids), len(seq)):
    gram = tuple(seq[max(0, j - n + 1):j + 1])
    hits += gram in seen
    seen.add(gram)
  return hits / max(len(continuation_ids), 1)


class FileLines:
  """A held-out file's lines (`splitlines(keepends=True)`, as the trainers cut them) and
  each line's token count, so that spans can be sized without re-encoding them."""

  def __init__(self, source: data.SourceFile, tokenizer):
    self.path = source.path
    self.lines = source.text.splitlines(keepends=True)
    self.counts = [len(tokenizer.encode(line)) for line in self.lines]
    self.tokenizer = tokenizer

  def span_before(self, end: int, max_tokens: int) -> Tuple[int, int]:
    """(start, tokens): the longest run of whole lines [start, end) of at most
    `max_tokens` tokens (counted line by line)."""
    start, count = end, 0
    while start > 0 and count + self.counts[start - 1] <= max_tokens:
      start -= 1
      count += self.counts[start]
    return start, count

  def span_from(self, start: int, max_tokens: int) -> Tuple[int, int]:
    """(end, tokens): the longest run of whole lines [start, end) of at most `max_tokens`."""
    end, count = start, 0
    while end < len(self.lines) and count + self.counts[end] <= max_tokens:
      count += self.counts[end]
      end += 1
    return end, count

  def text(self, start: int, end: int) -> str:
    return "".join(self.lines[start:end])

  def ids(self, start: int, max_tokens: int) -> List[int]:
    """The reference ids from line `start` on, cut to `max_tokens`."""
    end, _ = self.span_from(start, max_tokens + 200)
    return self.tokenizer.encode_lines(self.text(start, end))[:max_tokens]


def prefix_candidates(view: FileLines, token_range: Tuple[int, int], answer_tokens: int,
                      stride: int = 3) -> List[Candidate]:
  """Code prefixes of whole lines ending before a non-blank line, of `token_range` tokens,
  each scored by how much of its next `answer_tokens` reference tokens it copies."""
  out = []
  for i in range(1, len(view.lines), stride):
    if not view.lines[i].strip():
      continue
    start, _ = view.span_before(i, token_range[1])
    text = view.text(start, i)
    count = prompt_tokens(view.tokenizer, text)
    if not token_range[0] <= count <= token_range[1] or not clean(text):
      continue
    ref = view.ids(i, answer_tokens)
    if len(ref) < answer_tokens // 2:
      continue
    out.append(Candidate(view.path, i, (text,),
                         copy_fraction(view.tokenizer.encode(text), ref)))
  return out


def multi_turn_candidates(view: FileLines, budget: PairBudget,
                          stride: int = 3) -> List[Candidate]:
  """Two turns: a code prefix, then the whole lines after its 3-line reference continuation
  (the answer stands for those), each of at most `multi_turn_first[1]` tokens and both
  within `multi_turn_total`."""
  out = []
  low, high = budget.multi_turn_first
  for i in range(1, len(view.lines) - 4, stride):
    if not view.lines[i].strip():
      continue
    start, _ = view.span_before(i, high)
    first = view.text(start, i)
    first_count = prompt_tokens(view.tokenizer, first)
    if not low <= first_count <= high:
      continue
    # Turn 2 is no longer than turn 1 may be, and the two within the total.
    rest = min(budget.multi_turn_total - first_count, high)
    end, _ = view.span_from(i + 3, rest)
    second = view.text(i + 3, end)
    if (end == i + 3 or not second.strip() or not clean(first + second)
        or prompt_tokens(view.tokenizer, second) > rest):
      continue
    out.append(Candidate(view.path, i, (first, second), 0.0))
  return out


def parse_quietly(view: FileLines) -> Optional[ast.AST]:
  """The file's syntax tree, or None for the few test data files that are invalid on
  purpose (the SyntaxWarnings of some test files' old escape sequences silenced)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      return ast.parse("".join(view.lines))
    except SyntaxError:
      return None


def docstring_candidates(view: FileLines, budget: PairBudget) -> List[Candidate]:
  """A function's `def` line(s) and docstring, where its body has more after them."""
  tree = parse_quietly(view)
  if tree is None:
    return []
  out = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    if ast.get_docstring(node) is None or len(node.body) < 2:
      continue
    text = view.text(node.lineno - 1, node.body[0].end_lineno)
    count = prompt_tokens(view.tokenizer, text)
    if count > budget.prompt_range[1] or not clean(text):
      continue
    ref = view.ids(node.body[0].end_lineno, budget.answer_tokens)
    out.append(Candidate(view.path, node.lineno, (text,),
                         copy_fraction(view.tokenizer.encode(text), ref)))
  return out


# ----------------------------------------------------------------------------
# Choosing the questions
# ----------------------------------------------------------------------------

# completion (and long_context) keep prefixes whose reference continuation copies at
# most a quarter of its 3-grams from them, so that a draft must predict code, not find
# it; editing keeps those that copy at least 85% (25 held-out files have one for T5, 21
# for decoder-only; on 1024 sampled windows, 90% or 95% did not place prompt lookup
# better against the model draft).
MAX_COPIED_COMPLETION = 0.25
MIN_COPIED_EDITING = 0.85


def category_candidates(category: str, view: FileLines, budget: PairBudget
                        ) -> List[Candidate]:
  """Every candidate of `category` in one held-out file."""
  if category == "completion":
    found = prefix_candidates(view, budget.prompt_range, budget.answer_tokens)
    return [c for c in found if c.copied <= MAX_COPIED_COMPLETION]
  if category == "long_context":
    found = prefix_candidates(view, budget.long_range, budget.answer_tokens)
    return [c for c in found if c.copied <= MAX_COPIED_COMPLETION]
  if category == "docstring_to_code":
    return docstring_candidates(view, budget)
  if category == "editing":
    found = prefix_candidates(view, budget.prompt_range, budget.answer_tokens)
    return [c for c in found if c.copied >= MIN_COPIED_EDITING]
  if category == "multi_turn":
    return multi_turn_candidates(view, budget)
  raise ValueError(f"unknown category {category!r}; known: {', '.join(CATEGORIES)}")


def choose(category: str, views: Sequence[FileLines], budget: PairBudget, count: int,
           seed: int) -> List[Candidate]:
  """`count` candidates of `category`, each from a different file, drawn with a generator
  seeded by (seed, the category's index): files in a seeded order, one candidate each."""
  rng = np.random.default_rng([seed, CATEGORIES.index(category)])
  chosen = []
  for index in rng.permutation(len(views)):
    found = [c for c in category_candidates(category, views[index], budget)
             if fits(budget, views[index].tokenizer, c.turns)]
    if found:
      chosen.append(found[int(rng.integers(len(found)))])
    if len(chosen) == count:
      return chosen
  raise ValueError(f"{budget.name}: only {len(chosen)} held-out files have a {category} "
                   f"question, {count} wanted")


def heldout_views(tokenizer, root: Optional[str] = None) -> List[FileLines]:
  """The held-out stdlib files (the trainers' split), as `FileLines`, sorted by path."""
  _, heldout = data.split_files(data.stdlib_files(root), HELDOUT_PERCENT)
  return [FileLines(f, tokenizer) for f in heldout]


def build_questions(budget: PairBudget, views: Sequence[FileLines], seed: int,
                    per_category: int = PER_CATEGORY) -> List[Dict]:
  """The pair's questions in Spec-Bench's layout, categories in `CATEGORIES` order,
  question ids from 1."""
  rows = []
  for category in CATEGORIES:
    for c in choose(category, views, budget, per_category, seed):
      rows.append({"question_id": len(rows) + 1, "category": category, "turns": list(c.turns)})
  return rows


def benchmark_bytes(rows: Sequence[Dict]) -> bytes:
  """question.jsonl's bytes: one JSON object a line, UTF-8, keys in Spec-Bench's order."""
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


# ----------------------------------------------------------------------------
# --measure: tau and alpha of three drafts per category
# ----------------------------------------------------------------------------

def model_inputs(pair, text: str) -> Tuple[np.ndarray, Optional[np.ndarray]]:
  """One text as `generate`'s inputs, the family's way (`text_inputs`: T5 appends EOS;
  decoder-only prompts stay as they are), padded to a multiple of 64 so that prompts of
  similar lengths share one compiled program."""
  from specdec_jax.families.registry import family_of
  ids = pair.tokenizer.encode(text)
  width = 64 * (-(-(len(ids) + 1) // 64))
  return family_of(pair.target).text_inputs(pair.target.config, [ids], width)


def measurement_drafts(pair) -> Dict[str, object]:
  """The three drafts --measure compares: the pair's first model draft, prompt lookup and
  the bigram."""
  import specdec_jax as sj
  model_name = next(iter(pair.drafts))
  return {f"model ({model_name})": sj.ModelDraft(pair.drafts[model_name]),
          "prompt lookup": sj.PromptLookupDraft(pair.tokenizer.vocab_size, max_ngram=3,
                                                min_ngram=1),
          "bigram": pair.ngrams["bigram"]}


def measure(pair, rows: Sequence[Dict], per_category: int) -> Dict[str, Dict[str, Tuple]]:
  """{category: {draft: (tau, alpha)}}: the first `per_category` questions' first turns,
  batch 1, greedy, gamma 4, pooled over the questions (tau = emitted / iterations, alpha
  = the summed per-step estimates over their count)."""
  import specdec_jax as sj
  drafts = measurement_drafts(pair)
  table = {}
  for category in CATEGORIES:
    texts = [r["turns"][0] for r in rows if r["category"] == category][:per_category]
    table[category] = {}
    for name, draft in drafts.items():
      emitted = iterations = beta_sum = beta_count = 0
      for text in texts:
        tokens, lengths = model_inputs(pair, text)
        stats = sj.generate(pair.target, tokens, lengths, max_decode_steps=pair.max_decode_steps,
                            draft=draft, gamma=4).stats
        emitted += int(stats.emitted.sum())
        iterations += int(stats.iterations.sum())
        beta_sum += float(stats.beta_sum.sum())
        beta_count += int(stats.beta_count.sum())
      table[category][name] = (emitted / max(iterations, 1), beta_sum / max(beta_count, 1))
  return table


def table_markdown(table: Dict[str, Dict[str, Tuple]], counts: Dict[str, int]) -> str:
  """The --measure table: a row per category, tau / alpha per draft, the best tau in bold."""
  names = list(next(iter(table.values())))
  lines = ["| category | questions | " + " | ".join(f"{n}: tau / alpha" for n in names) + " |",
           "|---|---|" + "---|" * len(names)]
  for category, by_draft in table.items():
    best = max(by_draft.values())[0]
    cells = [(f"**{tau:.2f}**" if tau == best else f"{tau:.2f}") + f" / {alpha:.2f}"
             for tau, alpha in by_draft.values()]
    lines.append(f"| {category} | {counts[category]} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out_root", default=_REPO,
                      help="Where the pairs' directories are (their benchmark.jsonl is "
                           "written there); default: the repository.")
  parser.add_argument("--pairs", default=",".join(BUDGETS),
                      help="Comma-separated pairs: t5, decoder_only.")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--stdlib_root", default=None,
                      help="The corpus root (default: the running interpreter's stdlib, "
                           "which the pairs were trained on).")
  parser.add_argument("--measure", action="store_true",
                      help="Print tau / alpha per category per draft instead of writing.")
  parser.add_argument("--per_category", type=int, default=PER_CATEGORY,
                      help="--measure: questions decoded per category.")
  return parser.parse_args(argv)


def main(argv: Sequence[str]) -> None:
  args = parse_args(argv)
  tokenizer = data.Tokenizer.load(TOKENIZER)
  views = heldout_views(tokenizer, args.stdlib_root)
  for name in args.pairs.split(","):
    budget = BUDGETS[name]
    rows = build_questions(budget, views, args.seed)
    if not args.measure:
      path = os.path.join(args.out_root, budget.out_dir, BENCHMARK_FILE)
      data.write_bytes_atomic(path, benchmark_bytes(rows))
      print(f"{path}: {len(rows)} questions")
      continue
    from specdec_jax.demo_pair import load_demo_pair
    pair = load_demo_pair(name, with_feature_head=False)
    counts = {c: min(args.per_category, sum(r["category"] == c for r in rows))
              for c in CATEGORIES}
    print(f"\n{name}:\n" + table_markdown(measure(pair, rows, args.per_category), counts))


if __name__ == "__main__":
  main(sys.argv[1:])
