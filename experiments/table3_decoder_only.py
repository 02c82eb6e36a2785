r"""A small Table 3 (the paper's GPT-like row) with decoder-only models, on this machine.

The paper's Table 3 measures alpha for a GPT-like 97M target on LM1B with
unigram, bigram and a GPT-like 6M draft: 0.03 / 0.05 / 0.88 at temperature 0
and 0.03 / 0.05 / 0.89 at temperature 1. Here, offline and on a CPU:

  corpus   the Python standard library's source (specdec_jax.data), split by
           file into train / held-out, a SentencePiece tokenizer trained on it,
           GPT-style windows (`train_decoder_only.lm_windows`);
  models   a GPT-2-layout target and a ~10x smaller GPT-2-layout draft,
           trained together on the same batches (`joint_causal_lm_loss_fn`),
           then the draft optionally distilled (`distill_decoder_only_drafts`);
  drafts   unigram and bigram `NgramDraft`s fitted on the training windows;
  alpha    from speculative decoding statistics (Corollary 3.6) continuing
           held-out prompts, at temperature 0 and 1.

The default sizes train in minutes and are far from the paper's; the alphas
show the ordering (n-grams << a trained small model), not the paper's values.
Models are not saved: shipping a trained pair is the next step of issue 16.

  python -m experiments.table3_decoder_only --steps=300 --output_json=/tmp/table3.json
"""

import time
from typing import Any, Dict

from absl import app, flags
import jax
import numpy as np

from specdec_jax import data
from specdec_jax import train
from specdec_jax import train_decoder_only as tdo
from specdec_jax.decoder_only_model import DecoderOnlyModel, init_decoder_only_params
from specdec_jax.drafts import NgramDraft
from specdec_jax.models.decoder_configs import DecoderOnlyConfig
from specdec_jax.results import write_json_atomic

FLAGS = flags.FLAGS
flags.DEFINE_integer("vocab_size", 1024, "SentencePiece vocabulary (upper bound).")
flags.DEFINE_integer("max_files", 300, "Training files used (tokenizer and windows).")
flags.DEFINE_integer("window", 64, "Training window length.")
flags.DEFINE_integer("steps", 300, "Joint training steps (target and draft).")
flags.DEFINE_integer("distill_steps", 0, "Draft distillation steps after training (0 = none).")
flags.DEFINE_integer("batch_size", 32, "Windows per step.")
flags.DEFINE_float("learning_rate", 3e-3, "AdamW learning rate.")
flags.DEFINE_integer("num_prompts", 32, "Held-out prompts for alpha.")
flags.DEFINE_integer("prompt_length", 24, "Held-out prompt length.")
flags.DEFINE_integer("new_tokens", 24, "Tokens generated per prompt when measuring alpha.")
flags.DEFINE_integer("gamma", 4, "Drafted tokens per iteration when measuring alpha.")
flags.DEFINE_integer("seed", 0, "Seed for weights, data order and sampling.")
flags.DEFINE_string("output_json", "", "Write the results here (atomically).")

# The paper's Table 3, GPT-like (97M) target on LM1B: alpha at (temp 0, temp 1).
PAPER_TABLE3_GPT = {"unigram": (0.03, 0.03), "bigram": (0.05, 0.05), "small model": (0.88, 0.89)}


def gpt_config(vocab_size: int, emb: int, layers: int, heads: int, positions: int):
  return DecoderOnlyConfig(family="gpt2", vocab_size=vocab_size, emb_dim=emb, num_layers=layers,
                           num_heads=heads, num_kv_heads=heads, head_dim=emb // heads,
                           mlp_dim=4 * emb, max_positions=positions, activation="gelu_new",
                           tie_word_embeddings=True, qkv_bias=True, out_bias=True,
                           mlp_bias=True, bos_id=None, eos_id=data.EOS_ID, pad_id=data.PAD_ID)


def run(vocab_size: int, max_files: int, window: int, steps: int, distill_steps: int,
        batch_size: int, learning_rate: float, num_prompts: int, prompt_length: int,
        new_tokens: int, gamma: int, seed: int) -> Dict[str, Any]:
  t0 = time.time()
  train_files, heldout_files = data.split_files(data.stdlib_files(), heldout_percent=5)
  train_files = train_files[:max_files]
  tokenizer = data.Tokenizer(data.train_tokenizer(
      (line for f in train_files for line in f.text.splitlines(keepends=True)), vocab_size,
      seed=seed))
  windows = tdo.lm_windows([f.text for f in train_files], tokenizer, window, data.EOS_ID)
  heldout = tdo.lm_windows([f.text for f in heldout_files], tokenizer,
                           prompt_length + new_tokens, data.EOS_ID)
  heldout = heldout[np.random.default_rng(seed).permutation(len(heldout))[:num_prompts]]
  prompts = heldout[:, :prompt_length]

  vocab = tokenizer.vocab_size
  positions = max(window, prompt_length + new_tokens)
  configs = {"target": gpt_config(vocab, 128, 4, 4, positions),
             "draft": gpt_config(vocab, 32, 1, 2, positions)}
  params = {name: init_decoder_only_params(c, seed + i) for i, (name, c) in
            enumerate(configs.items())}
  loss_fn = tdo.joint_causal_lm_loss_fn(configs)
  optimizer = train.make_optimizer("adamw", learning_rate, schedule="linear",
                                   warmup_steps=min(20, steps // 10), total_steps=steps)
  state = train.create_train_state(params, optimizer)
  step_fn = jax.jit(lambda s, b: train.train_step(s, b, loss_fn=loss_fn, optimizer=optimizer))
  order = np.random.default_rng(seed + 1).permutation(len(windows))
  history = []
  for step in range(steps):
    rows = order[np.arange(step * batch_size, (step + 1) * batch_size) % len(order)]
    state, metrics = step_fn(state, tdo.lm_batch(windows[rows], [window] * len(rows)))
    if step % 50 == 0 or step == steps - 1:
      history.append({k: float(v) for k, v in metrics.items()} | dict(step=step))
  target = DecoderOnlyModel(configs["target"], state.params["target"])
  small = DecoderOnlyModel(configs["draft"], state.params["draft"])
  distilled = None
  if distill_steps:
    distilled = tdo.distill_decoder_only_drafts(
        target, {"draft": small}, windows[:512, :prompt_length], [prompt_length] * min(
            512, len(windows)), steps=distill_steps, max_decode_steps=new_tokens, seed=seed)
    small = distilled["drafts"]["draft"]

  drafts = {"unigram": NgramDraft.fit(windows, vocab, order=1, smoothing=0.1,
                                      eos_id=data.EOS_ID, pad_id=data.PAD_ID),
            "bigram": NgramDraft.fit(windows, vocab, order=2, smoothing=0.1,
                                     eos_id=data.EOS_ID, pad_id=data.PAD_ID),
            "small model": small}
  lengths = [prompt_length] * len(prompts)
  alphas = {name: tuple(tdo.measure_alpha(target, draft, prompts, lengths,
                                          max_decode_steps=new_tokens, temperature=t,
                                          gamma=gamma, seed=seed) for t in (0.0, 1.0))
            for name, draft in drafts.items()}
  return dict(vocab_size=vocab, train_windows=len(windows), window=window, steps=steps,
              distill_steps=distill_steps, target_params=configs["target"].num_params,
              draft_params=configs["draft"].num_params, history=history,
              distill=None if distilled is None else {k: v for k, v in distilled.items()
                                                     if k != "drafts"},
              alpha=alphas, paper_gpt_like=PAPER_TABLE3_GPT, gamma=gamma,
              num_prompts=len(prompts), prompt_length=prompt_length, new_tokens=new_tokens,
              seconds=time.time() - t0)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  result = run(FLAGS.vocab_size, FLAGS.max_files, FLAGS.window, FLAGS.steps, FLAGS.distill_steps,
               FLAGS.batch_size, FLAGS.learning_rate, FLAGS.num_prompts, FLAGS.prompt_length,
               FLAGS.new_tokens, FLAGS.gamma, FLAGS.seed)
  print(f"target {result['target_params']:,} params, draft {result['draft_params']:,}; "
        f"{result['train_windows']} windows of {result['window']}, {result['steps']} steps, "
        f"{result['seconds']:.0f} s; final loss {result['history'][-1]}")
  print("| draft | alpha t=0 | alpha t=1 | paper t=0 | paper t=1 |")
  print("|---|---|---|---|---|")
  for name, (a0, a1) in result["alpha"].items():
    p0, p1 = PAPER_TABLE3_GPT[name]
    print(f"| {name} | {a0:.2f} | {a1:.2f} | {p0:.2f} | {p1:.2f} |")
  if FLAGS.output_json:
    write_json_atomic(FLAGS.output_json, result)
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
  app.run(main)
