r"""specdec_jax next to Hugging Face transformers on the same weights (batch 1).

Builds a T5 target and draft in transformers (PyTorch) with random weights,
saves them with `save_pretrained` and loads the same files with
`specdec_jax.load_model`, so both frameworks run identical weights. Then, in
one process and interleaved repeats, times:

  ours AR        specdec_jax.generate(target)                       (greedy)
  ours SD        specdec_jax.generate(target, draft=draft, gamma=g)  (greedy)
  HF greedy      target.generate(do_sample=False)
  HF assisted    target.generate(assistant_model=draft), g assistant tokens,
                 constant schedule, no confidence early stop

All four generate exactly `--new_tokens` tokens: HF with min_new_tokens =
max_new_tokens, ours with an EOS id that never fires. Before timing, checks
that our greedy tokens equal HF's on the first tokens (same weights, same
argmax). Needs the `parity` extra (torch, transformers, safetensors).

  python scripts/hf_peer.py --config=t5_1_1_small --draft_noise=0.1 --gamma=4 \
    --new_tokens=64 --repeats=5 --output_json=/tmp/hf_peer.json
"""

import os
import statistics
import tempfile
import time
from typing import Any, Dict

from absl import app
from absl import flags
import jax
import numpy as np

from specdec_jax import generation
from specdec_jax.families.t5.checkpoints import t5config_to_hf_config
from specdec_jax.loading import load_model
from specdec_jax.families.t5.config import T5Config, get_config
from specdec_jax.core.results import write_json_atomic

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "t5_1_1_small", "Target shape (a specdec_jax config name).")
flags.DEFINE_string("draft_config", "", "Draft shape (config name, target's vocabulary). "
                    "Empty: a perturbed copy of the target (--draft_noise).")
flags.DEFINE_float("draft_noise", 0.1, "Perturbed-copy draft: w -> w * (1 + s * N(0, 1)).")
flags.DEFINE_integer("vocab_size", 0, "Override the vocabulary (0 = the config's).")
flags.DEFINE_integer("gamma", 4, "Drafted tokens per iteration (HF num_assistant_tokens).")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per call.")
flags.DEFINE_integer("encoder_length", 32, "Encoder input length (random tokens).")
flags.DEFINE_integer("repeats", 5, "Timed repeats (after a warm-up call of each).")
flags.DEFINE_integer("seed", 0, "Seed for weights and inputs.")
flags.DEFINE_integer("torch_threads", 0, "torch.set_num_threads (0 = torch's default).")
flags.DEFINE_string("output_json", "", "Write the results here (atomically).")

NO_EOS = -1  # Never emitted: our decoders then run all new_tokens steps.


def hf_config(config: T5Config):
  """The transformers `T5Config` for a specdec_jax `T5Config` (the one export_hf writes)."""
  import transformers
  return transformers.T5Config(**t5config_to_hf_config(config))


def build_hf_pair(target_config: T5Config, draft_config, noise: float, seed: int):
  """(target, draft) `T5ForConditionalGeneration`s in eval mode, random weights."""
  import torch
  import transformers
  torch.manual_seed(seed)
  target = transformers.T5ForConditionalGeneration(hf_config(target_config)).eval()
  if draft_config is not None:
    torch.manual_seed(seed + 1)
    return target, transformers.T5ForConditionalGeneration(hf_config(draft_config)).eval()
  draft = transformers.T5ForConditionalGeneration(hf_config(target_config)).eval()
  generator = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    state = target.state_dict()
    for name, weight in draft.state_dict().items():
      source = state[name]
      weight.copy_(source * (1 + noise * torch.randn(source.shape, generator=generator)))
  return target, draft


def _seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def run(config_name: str, draft_config_name: str, noise: float, vocab_size: int, gamma: int,
        new_tokens: int, encoder_length: int, repeats: int, seed: int,
        torch_threads: int = 0) -> Dict[str, Any]:
  import torch
  if torch_threads:
    torch.set_num_threads(torch_threads)
  overrides = dict(vocab_size=vocab_size) if vocab_size else {}
  target_config = get_config(config_name, **overrides)
  draft_config = (get_config(draft_config_name, vocab_size=target_config.vocab_size)
                  if draft_config_name else None)
  hf_target, hf_draft = build_hf_pair(target_config, draft_config, noise, seed)
  with tempfile.TemporaryDirectory() as tmp:
    hf_target.save_pretrained(os.path.join(tmp, "target"))
    hf_draft.save_pretrained(os.path.join(tmp, "draft"))
    target = load_model(os.path.join(tmp, "target"), dtype="float32")
    draft = load_model(os.path.join(tmp, "draft"), dtype="float32")

  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, target_config.vocab_size, (1, encoder_length)).astype(np.int32)
  torch_tokens = torch.tensor(tokens, dtype=torch.long)
  hf_draft.generation_config.num_assistant_tokens = gamma
  hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
  # transformers stops drafting early below this draft confidence by default;
  # 0 keeps gamma fixed, as in the paper and in our decoder.
  hf_draft.generation_config.assistant_confidence_threshold = 0.0
  hf_kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

  def ours_ar():
    out = generation.generate(target, tokens, max_decode_steps=new_tokens, eos_id=NO_EOS)
    return np.asarray(jax.block_until_ready(out.sequences))

  def ours_sd():
    out = generation.generate(target, tokens, max_decode_steps=new_tokens, eos_id=NO_EOS,
                              draft=draft, gamma=gamma)
    jax.block_until_ready(out.sequences)
    return out

  def hf_greedy():
    with torch.no_grad():
      return hf_target.generate(torch_tokens, **hf_kwargs)

  def hf_assisted():
    with torch.no_grad():
      return hf_target.generate(torch_tokens, assistant_model=hf_draft, **hf_kwargs)

  # Warm-up (compiles ours) and the parity check: same weights, same argmax.
  ours_tokens = ours_ar()[0]
  sd_out = ours_sd()
  hf_tokens = hf_greedy()[0, 1:].numpy()  # drop the decoder start token
  hf_assisted_tokens = hf_assisted()[0, 1:].numpy()
  # HF forbids EOS until new_tokens (min_new_tokens); compare up to the first
  # place either side emitted the EOS id.
  eos = [i for i, t in enumerate(ours_tokens) if t == target_config.eos_id]
  compare = eos[0] if eos else new_tokens
  parity = dict(
      compared_tokens=compare,
      ours_ar_equals_hf_greedy=bool(np.array_equal(ours_tokens[:compare], hf_tokens[:compare])),
      ours_sd_equals_ours_ar=bool(np.array_equal(np.asarray(sd_out.sequences[0]), ours_tokens)),
      hf_assisted_equals_hf_greedy=bool(np.array_equal(hf_assisted_tokens, hf_tokens)),
      first_mismatch_ours_vs_hf=next((i for i in range(compare)
                                      if ours_tokens[i] != hf_tokens[i]), None))

  jobs = dict(ours_ar=ours_ar, ours_sd=ours_sd, hf_greedy=hf_greedy, hf_assisted=hf_assisted)
  compiles_before = generation.compile_count()
  seconds = {name: [] for name in jobs}
  for repeat in range(repeats):
    names = list(jobs) if repeat % 2 == 0 else list(jobs)[::-1]
    for name in names:
      seconds[name].append(_seconds(jobs[name]))
  compiles_after = generation.compile_count()

  def ratio(a, b):
    ratios = [x / y for x, y in zip(seconds[a], seconds[b])]
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))

  timings = {name: dict(ms_per_token=statistics.median(s) * 1e3 / new_tokens,
                        tokens_per_s=new_tokens / statistics.median(s),
                        ms_all=[x * 1e3 for x in s]) for name, s in seconds.items()}
  return dict(
      config=config_name, draft=draft_config_name or f"target*(1+{noise:g}N)",
      vocab_size=target_config.vocab_size, gamma=gamma, new_tokens=new_tokens,
      encoder_length=encoder_length, repeats=repeats, batch_size=1,
      torch_threads=torch.get_num_threads(), torch=torch.__version__,
      transformers=__import__("transformers").__version__, jax=jax.__version__,
      nproc=os.cpu_count(), load_average=os.getloadavg(),
      parity=parity, timings=timings,
      alpha=sd_out.stats.alpha, mean_tokens_per_iteration=sd_out.stats.mean_tokens_per_iteration,
      # > 1 means ours is faster (ratio of HF time to ours, paired per repeat).
      ar_speed_ratio_vs_hf_greedy=ratio("hf_greedy", "ours_ar"),
      sd_speed_ratio_vs_hf_assisted=ratio("hf_assisted", "ours_sd"),
      ours_sd_speedup=ratio("ours_ar", "ours_sd"),
      hf_assisted_speedup=ratio("hf_greedy", "hf_assisted"),
      compile_count_before=compiles_before, compile_count_after=compiles_after)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  result = run(FLAGS.config, FLAGS.draft_config, FLAGS.draft_noise, FLAGS.vocab_size,
               FLAGS.gamma, FLAGS.new_tokens, FLAGS.encoder_length, FLAGS.repeats, FLAGS.seed,
               FLAGS.torch_threads)
  print(f"{result['config']} target, draft {result['draft']}, batch 1, gamma {result['gamma']}, "
        f"{result['new_tokens']} new tokens, alpha {result['alpha']:.2f}, "
        f"tokens/iteration {result['mean_tokens_per_iteration']:.2f}")
  print(f"parity: {result['parity']}")
  for name, t in result["timings"].items():
    print(f"  {name:12s} {t['ms_per_token']:8.2f} ms/token {t['tokens_per_s']:8.1f} tokens/s")
  for key in ("ar_speed_ratio_vs_hf_greedy", "sd_speed_ratio_vs_hf_assisted", "ours_sd_speedup",
              "hf_assisted_speedup"):
    r = result[key]
    print(f"  {key:30s} {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
  print(f"compile count {result['compile_count_before']} -> {result['compile_count_after']}")
  if FLAGS.output_json:
    write_json_atomic(FLAGS.output_json, result)
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
  app.run(main)
