"""Markdown tables of `scripts/benchmark.py` method-comparison JSONs (issue 22).

  python scripts/methods_table.py benchmarks/cpu/issue22/*_W12_T*.json

One line per (file, method): tokens per iteration measured and predicted, the
CPU speedup (median [min, max] of paired rounds) and its prediction from this
machine's c and C(W), and accelerator scenarios tokens / (calls c + C(W)).
"""

import json
import sys


def rows(paths, scenario_verify="0.92"):
  out = []
  for path in paths:
    with open(path) as f:
      doc = json.load(f)
    for res in doc["results"]:
      for r in res["methods"]:
        acc = r["accelerator_predictions"]
        c_here = res["c"]
        pick = lambda c: next(v for k, v in acc.items()  # noqa: E731
                              if k == f"C={scenario_verify},c={c:g}")
        pred = r["predicted_tokens_per_iteration"]
        ident = {None: "-", True: "yes", False: "NO"}[r["identical_greedy_outputs"]]
        out.append(
            f"| {doc['settings']['pair'] or doc['settings']['target']} | {res['temperature']:g} "
            f"| {res['block_width']} | {r['method']} | {r['draft_calls']} "
            f"| {r['tokens_per_iteration']:.2f} | {'-' if pred is None else f'{pred:.2f}'} "
            f"| {r['alpha']:.2f} | {r['speedup']:.2f} [{r['speedup_min']:.2f}, "
            f"{r['speedup_max']:.2f}] | {r['predicted_speedup_here']:.2f} "
            f"| {c_here:.3f} / {res['verify_cost']:.2f} "
            f"| {pick(c_here):.2f} | {pick(0.126):.2f} | {pick(0.039):.2f} | {ident} |")
  return out


HEADER = ("| pair | T | W | method | draft calls | tok/it | predicted tok/it | α "
          "| CPU speedup [min, max] | CPU predicted | CPU c / C(W) "
          "| accel. C={C}, c=CPU | accel. C={C}, c=0.126 | accel. C={C}, c=0.039 | greedy identical |")


def main(argv):
  verify = "0.92"
  paths = []
  for a in argv[1:]:
    if a.startswith("--verify_cost="):
      verify = a.split("=", 1)[1]
    else:
      paths.append(a)
  print(HEADER.format(C=verify))
  print("|" + "---|" * (HEADER.count("|") - 1))
  print("\n".join(rows(paths, verify)))


if __name__ == "__main__":
  main(sys.argv)
