"""The standard evaluation: methods x categories of a benchmark (Spec-Bench's table).

  questions.py    Question, Benchmark: what an evaluation reads
  benchmarks.py   the public formats read into a Benchmark (Spec-Bench, MT-Bench,
                  SPEED-Bench, plain files, the paper's tasks)
  conversation.py a turn's prompt from the turns and answers before it (chat templates)
  methods.py      the named methods (a draft, gamma, the verification) of a target
  runner.py       the decodes, interleaved input by input, timed; records
  store.py        the records on disk: a run resumes per (method, input)
  metrics.py      records -> speedup, tau, alpha, tokens/s, equal per category
  law.py          sampled outputs: the exact sign tests of their law
  report.py       results.json, results.md and the plot

`python -m experiments.evaluate` is the command line.
"""
