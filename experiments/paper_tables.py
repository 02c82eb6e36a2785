"""Numbers printed in Leviathan et al. 2023 (see shared REFERENCE §1), as data."""

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class Table2Row:
  """One row of Table 2, with Table 4's predicted speedup and c."""
  task: str          # 'ende' or 'cnndm'
  draft: str         # 'small', 'base' or 'large' (T5 1.1 drafts of a T5 1.1 XXL target)
  temperature: float
  gamma: int
  alpha: float
  speedup: float     # measured on TPU-v4, batch 1
  predicted: float   # Table 4: Theorem 3.8 from the rounded alpha and c
  c: float

  @property
  def name(self) -> str:
    return f"{self.task}_{self.draft}_t{self.temperature:g}"


TABLE2: Tuple[Table2Row, ...] = (
    Table2Row("ende", "small", 0, 7, 0.75, 3.4, 3.2, 0.02),
    Table2Row("ende", "base", 0, 7, 0.80, 2.8, 3.3, 0.04),
    Table2Row("ende", "large", 0, 7, 0.82, 1.7, 2.5, 0.11),
    Table2Row("ende", "small", 1, 7, 0.62, 2.6, 2.3, 0.02),
    Table2Row("ende", "base", 1, 5, 0.68, 2.4, 2.4, 0.04),
    Table2Row("ende", "large", 1, 3, 0.71, 1.4, 2.0, 0.11),
    Table2Row("cnndm", "small", 0, 5, 0.65, 3.1, 2.4, 0.02),
    Table2Row("cnndm", "base", 0, 5, 0.73, 3.0, 2.6, 0.04),
    Table2Row("cnndm", "large", 0, 3, 0.74, 2.2, 2.0, 0.11),
    Table2Row("cnndm", "small", 1, 5, 0.53, 2.3, 1.9, 0.02),
    Table2Row("cnndm", "base", 1, 3, 0.55, 2.2, 1.8, 0.04),
    Table2Row("cnndm", "large", 1, 3, 0.56, 1.7, 1.6, 0.11),
)

# Table 1 (c = c_hat = 0): (alpha, gamma) -> (operations increase, walltime improvement).
TABLE1 = {
    (0.6, 2): (1.53, 1.96),
    (0.7, 3): (1.58, 2.53),
    (0.8, 2): (1.23, 2.44),
    (0.8, 5): (1.63, 3.69),
    (0.9, 2): (1.11, 2.71),
    (0.9, 10): (1.60, 6.86),
}
