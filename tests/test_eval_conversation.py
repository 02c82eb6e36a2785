"""evaluation.conversation: multi-turn prompts rendered as transformers renders them.

Each template is written into a tokenizer directory (tokenizer.json +
tokenizer_config.json), loaded by transformers' AutoTokenizer, and
`next_prompt` for 1, 2 and 3 turns is compared with
`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`.
"""

import json

import pytest

from specdec_jax import text as text_lib
from specdec_jax.evaluation import conversation
from specdec_jax.evaluation.questions import Benchmark, Question

TURNS = ("Write a haiku about <b>JAX</b>.", "Now one about café tables.\nTwo lines.",
         "  And a third, trimmed?  ")
ANSWERS = ("Arrays in flight, \"jit\" compiles", "Café au lait\n{steam}")

# Qwen2.5's template (ChatML), as its tokenizer_config.json ships it.
QWEN_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\n<tools>\" }}\n    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# Llama 3's shape: BOS, headers, trimmed contents, a namespace, loop controls, a date
# and a refusal of roles out of order.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- set ns = namespace(turn=0) %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nYear: ' + strftime_now('%Y') }}"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'system' %}\n        {%- continue %}\n    {%- endif %}\n"
    "    {%- if (message['role'] == 'user') != (ns.turn % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/"
    "assistant/...') }}\n    {%- endif %}\n"
    "    {%- set ns.turn = ns.turn + 1 %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- if loop.index > 8 %}{% break %}{% endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n")

# transformers' extras: its tojson (no HTML escapes, non-ASCII kept), dict(),
# {% generation %}, tools/documents passed as None, eos_token.
# transformers' extras: its tojson (no HTML escapes, non-ASCII kept), dict(),
# {% generation %}, tools/documents passed as None, eos_token; indented block tags
# without dashes (trim_blocks and lstrip_blocks decide the whitespace).
EXTRAS_TEMPLATE = """{% for message in messages %}
  {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{{ eos_token }}{% endgeneration %}

  {% else %}
{{ dict(role=message.role, n=loop.index) | tojson }} {{ message | tojson(indent=1) }}
  {% endif %}
{% endfor %}
{% if tools is defined and tools is none %}[tools none]{% endif %}
{% if documents is not none %}[documents]{% endif %}
{% if add_generation_prompt %}>>> {% endif %}"""

SPECIAL = {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>"}


def _tokenizer_dir(tmp_path, name, template):
  """A WordLevel tokenizer.json and a tokenizer_config.json holding `template`."""
  tokenizers = pytest.importorskip("tokenizers")
  directory = tmp_path / name
  directory.mkdir()
  vocab = {"[UNK]": 0, SPECIAL["bos"]: 1, SPECIAL["eos"]: 2, "hello": 3}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(dict(
      tokenizer_class="PreTrainedTokenizerFast", bos_token=SPECIAL["bos"],
      eos_token=SPECIAL["eos"], unk_token="[UNK]", chat_template=template)))
  return directory


def _messages(turns, answers):
  out = []
  for i, turn in enumerate(turns):
    out.append({"role": "user", "content": turn})
    if i < len(answers):
      out.append({"role": "assistant", "content": answers[i]})
  return out


@pytest.mark.parametrize("name,template", [("qwen", QWEN_TEMPLATE), ("llama3", LLAMA3_TEMPLATE),
                                           ("extras", EXTRAS_TEMPLATE)])
def test_next_prompt_equals_transformers_apply_chat_template(tmp_path, name, template):
  transformers = pytest.importorskip("transformers")
  directory = _tokenizer_dir(tmp_path, name, template)
  hf = transformers.AutoTokenizer.from_pretrained(str(directory))
  for n in (1, 2, 3):
    turns, answers = TURNS[:n], ANSWERS[:n - 1]
    expected = hf.apply_chat_template(_messages(turns, answers), tokenize=False,
                                      add_generation_prompt=True)
    got = conversation.next_prompt(turns, answers, template=template,
                                   bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"])
    assert got == expected, (name, n)
  # The launcher's one-turn render_chat goes through the same renderer.
  tokenizer = text_lib.read_tokenizer(str(directory / "tokenizer.json"))
  assert text_lib.render_chat(tokenizer, TURNS[0]) == hf.apply_chat_template(
      _messages(TURNS[:1], ()), tokenize=False, add_generation_prompt=True)


def test_templates_render_what_they_should():
  """The comparison above is only as good as what the templates exercise."""
  qwen = conversation.next_prompt(TURNS[:2], ANSWERS[:1], template=QWEN_TEMPLATE)
  assert qwen.startswith("<|im_start|>system\nYou are Qwen")
  assert qwen.endswith(f"<|im_start|>user\n{TURNS[1]}<|im_end|>\n<|im_start|>assistant\n")
  assert f"<|im_start|>assistant\n{ANSWERS[0]}<|im_end|>\n" in qwen
  llama = conversation.next_prompt(TURNS, ANSWERS, template=LLAMA3_TEMPLATE,
                                   bos_token=SPECIAL["bos"])
  assert llama.startswith(SPECIAL["bos"] + "<|start_header_id|>system")
  assert "user<|end_header_id|>\n\nAnd a third, trimmed?<|eot_id|>" in llama  # `trim`.
  extras = conversation.next_prompt(TURNS[:2], ANSWERS[:1], template=EXTRAS_TEMPLATE,
                                    eos_token=SPECIAL["eos"])
  assert '"content": "Write a haiku about <b>JAX</b>."' in extras  # No HTML escapes.
  assert '"Now one about café tables.\\nTwo lines."' in extras  # Non-ASCII kept.
  assert '{"role": "user", "n": 3}' in extras
  assert ANSWERS[0] + SPECIAL["eos"] in extras
  assert extras.endswith("}\n[tools none]>>> ")
  assert "\n  " not in extras.replace('\n  "', "")  # Block tags' indents stripped.


def test_template_refusal_and_turn_count_errors():
  refusing = "{% if messages | length > 1 %}{{ raise_exception('one turn only') }}{% endif %}x"
  assert conversation.next_prompt(["a"], [], template=refusing) == "x"
  with pytest.raises(ValueError, match="the chat template refused the prompt: one turn only"):
    conversation.next_prompt(["a", "b"], ["y"], template=refusing)
  with pytest.raises(ValueError, match="2 user turns need 1 answers before the next one, got 0"):
    conversation.next_prompt(["a", "b"], [], template=None)
  with pytest.raises(ValueError, match="at least one user turn"):
    conversation.next_prompt([], [], template=None)


def test_plain_fallback_text():
  assert conversation.next_prompt(["only turn"], [], template=None) == "only turn"
  assert conversation.next_prompt(["q1", "q2"], ["a1"], template=None) == "q1\na1\nq2"
  # A piece that ends in a newline gets no second one (code turns of whole lines).
  assert conversation.next_prompt(["q1\n", "q2", "q3"], ["a1\n", "a2"], template="") == (
      "q1\na1\nq2\na2\nq3")


def _benchmark(*turn_counts):
  return Benchmark("mini", "mini.jsonl", tuple(
      Question(str(i), "c", tuple(f"t{j}" for j in range(n))) for i, n in enumerate(turn_counts)))


def test_check_chat_template_refuses_multi_turn_without_template():
  multi = _benchmark(2, 1, 2)
  with pytest.raises(ValueError) as error:
    conversation.check_chat_template(multi, None, fallback_allowed=False,
                                     tokenizer_name="/ckpt/tokenizer.json")
  message = str(error.value)
  assert "/ckpt/tokenizer.json has no chat template" in message
  assert "has 2 multi-turn question(s) of 3" in message
  assert "--chat_template=plain uses " + conversation.PLAIN_DESCRIPTION in message
  assert "--chat_template=auto" in message
  assert conversation.check_chat_template(multi, None, True) == conversation.PLAIN
  assert conversation.check_chat_template(multi, "{{ x }}", False) == conversation.CHAT_TEMPLATE
  assert conversation.check_chat_template(_benchmark(1, 1), None, False) == conversation.PLAIN
