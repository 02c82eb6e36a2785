"""What an evaluation reads: categorized questions of one or more turns.

Every benchmark format (`evaluation.benchmarks`) is read into a `Benchmark`: a
list of `Question`s, each with its category and its user turns. The harness
(`experiments/evaluate.py`) decodes a question turn by turn, each turn's answer
fed into the next turn's prompt (`evaluation.conversation`).
"""

import dataclasses
from typing import Dict, List, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Question:
  """One benchmark input.

  question_id: unique within its benchmark (Spec-Bench's `question_id`, as a string).
  category: Spec-Bench's category ('mt_bench', 'translation', 'summarization', 'qa',
    'math_reasoning', 'rag'), MT-Bench's ('writing', ...), or the file's own.
  turns: the user turns, in order (one for a single-turn input).
  reference: reference answers where the format has them (not used for speed).
  """
  question_id: str
  category: str
  turns: Tuple[str, ...]
  reference: Optional[Tuple[str, ...]] = None


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """Questions read from one source.

  name: what results.json calls it ('spec_bench', 'mt_bench', 'demo_code', a file name).
  source: the path or dataset name it was read from.
  questions: in the file's order.
  concurrency: SPEED-Bench's throughput split: the batch size its inputs are meant for
    (`generate_many`'s batch_size); None elsewhere.
  """
  name: str
  source: str
  questions: Tuple[Question, ...]
  concurrency: Optional[int] = None

  @property
  def categories(self) -> List[str]:
    """The categories in order of first appearance."""
    return list(dict.fromkeys(q.category for q in self.questions))

  def by_category(self) -> Dict[str, List[Question]]:
    out: Dict[str, List[Question]] = {c: [] for c in self.categories}
    for q in self.questions:
      out[q.category].append(q)
    return out

  @property
  def multi_turn(self) -> bool:
    return any(len(q.turns) > 1 for q in self.questions)
