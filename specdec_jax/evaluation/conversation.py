"""Multi-turn prompts: the text decoded for each turn of a question.

A question of n user turns is decoded n times. Before turn k the model has seen
turns 1..k-1 and its own answers to them, so the k-th prompt renders the whole
conversation so far and asks for the next answer:

* With the tokenizer's chat template (`tokenizer_config.json`'s `chat_template`,
  or `chat_template.jinja` beside it): `messages` alternate
  `{"role": "user"}` / `{"role": "assistant"}` and the template is rendered with
  `add_generation_prompt=True`, exactly as transformers'
  `tokenizer.apply_chat_template(messages, tokenize=False,
  add_generation_prompt=True)` renders it (same jinja2 sandbox, options,
  filters and globals; tests/test_eval_conversation.py compares the two).
* Without one, the plain fallback (`PLAIN`, the harness's
  `--chat_template=plain`): the user turns and the answers, in order, each on
  lines of its own, so a second turn reads "turn 1\\nanswer 1\\nturn 2" (no newline
  added after a piece that ends in one). One turn is its text unchanged (what the launcher decodes without CHAT_TEMPLATE).

API:
  next_prompt(turns_so_far, answers_so_far, template=..., bos_token=, eos_token=)
  chat_messages(turns_so_far, answers_so_far) -> the messages list
  render_chat_template(template, messages, ...) -> the rendered text
  plain_prompt(turns_so_far, answers_so_far) -> the fallback's text
  check_chat_template(benchmark, template, fallback_allowed, tokenizer_name)
    -> CHAT_TEMPLATE or PLAIN, or a ValueError for a multi-turn benchmark with
       no template and no fallback asked for.
"""

import datetime
import functools
import json
import re
from typing import Any, Dict, List, Optional, Sequence

# What the harness records as the prompt format of a run.
CHAT_TEMPLATE = "chat_template"
PLAIN = "plain"
PLAIN_DESCRIPTION = ("the plain fallback: the user turns and the model's answers, in order, "
                     "each on lines of its own (turn 1, answer 1, turn 2, ...; a newline "
                     "added after a piece that does not end in one)")
# transformers refuses older jinja2: earlier releases have known sandbox escapes, and
# chat templates are code from the checkpoint's author.
_MIN_JINJA2 = (3, 1, 6)


def chat_messages(turns_so_far: Sequence[str],
                  answers_so_far: Sequence[str]) -> List[Dict[str, str]]:
  """The conversation before the next answer: user, assistant, ..., user.

  Args:
    turns_so_far: the user turns up to and including the one to answer now.
    answers_so_far: the model's answers to all turns but the last.

  Raises:
    ValueError: unless there is one answer fewer than turns.
  """
  if not turns_so_far:
    raise ValueError("next_prompt needs at least one user turn")
  if len(answers_so_far) != len(turns_so_far) - 1:
    raise ValueError(f"{len(turns_so_far)} user turns need {len(turns_so_far) - 1} answers "
                     f"before the next one, got {len(answers_so_far)}")
  messages = []
  for turn, answer in zip(turns_so_far, list(answers_so_far) + [None]):
    messages.append({"role": "user", "content": turn})
    if answer is not None:
      messages.append({"role": "assistant", "content": answer})
  return messages


def plain_prompt(turns_so_far: Sequence[str], answers_so_far: Sequence[str]) -> str:
  """The fallback without a chat template: turns and answers, each on lines of its own
  (a newline added after a piece that does not end in one, so that code turns made of
  whole lines read on as one file, without blank lines between them)."""
  pieces = [m["content"] for m in chat_messages(turns_so_far, answers_so_far)]
  return "".join(p if p.endswith("\n") or i == len(pieces) - 1 else p + "\n"
                 for i, p in enumerate(pieces))


def _jinja2_version(version: str):
  return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _template_error(message):
  raise ValueError(f"the chat template refused the prompt: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # jinja2's own tojson escapes HTML characters ('<' as \u003c); transformers'
  # does not, and templates print tool schemas with it.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(format_string):
  return datetime.datetime.now().strftime(format_string)


class _TemplateDict:
  """`dict` in a template: construction and fromkeys only, no class attributes."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str):
  """`template` compiled in transformers' environment (cached: one per tokenizer)."""
  try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
  except ImportError as e:
    raise ImportError("rendering a chat template needs jinja2 (pip install jinja2)") from e
  if _jinja2_version(jinja2.__version__) < _MIN_JINJA2:
    raise ImportError(f"rendering a chat template needs jinja2>=3.1.6 (installed: "
                      f"{jinja2.__version__}; pip install -U jinja2): older releases have "
                      "sandbox escapes")

  class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's
    tokens with it; rendered as text it is its body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        TemplateNamespace._check_name(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      TemplateNamespace._check_name(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore attributes on a namespace: {name!r}")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _template_error
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = TemplateNamespace
  return env.from_string(template)


def render_chat_template(template: str, messages: Sequence[Dict[str, Any]], *,
                         bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                         add_generation_prompt: bool = True) -> str:
  """`messages` through a chat template, as transformers' `apply_chat_template(...,
  tokenize=False)` renders them.

  bos_token / eos_token: the tokenizer's; None leaves them undefined in the template,
  as transformers does for a tokenizer without one (both render as "").

  Raises:
    ValueError: the template called raise_exception (e.g. roles out of order).
  """
  variables = {"messages": [dict(m) for m in messages],
               "add_generation_prompt": add_generation_prompt,
               # transformers always passes these (None without tools or documents);
               # templates test them with `is defined` / `is not none`.
               "tools": None, "documents": None}
  for name, token in (("bos_token", bos_token), ("eos_token", eos_token)):
    if token is not None:
      variables[name] = token
  return _compiled_template(template).render(**variables)


def next_prompt(turns_so_far: Sequence[str], answers_so_far: Sequence[str], *,
                template: Optional[str], bos_token: Optional[str] = None,
                eos_token: Optional[str] = None) -> str:
  """The text to decode for the last of `turns_so_far`.

  Args:
    turns_so_far: the user turns up to and including the one to answer now.
    answers_so_far: the model's answers to the turns before it (one fewer).
    template: the tokenizer's chat template; None (or "") gives `plain_prompt`.
    bos_token / eos_token: the strings the template writes for them.
  """
  if not template:
    return plain_prompt(turns_so_far, answers_so_far)
  return render_chat_template(template, chat_messages(turns_so_far, answers_so_far),
                              bos_token=bos_token, eos_token=eos_token)


def check_chat_template(benchmark, template: Optional[str], fallback_allowed: bool,
                        tokenizer_name: str = "the tokenizer") -> str:
  """Which prompt format a run uses: CHAT_TEMPLATE when there is a template, else PLAIN.

  Run before any decode: a multi-turn question without the model's chat format
  would decode a second turn the model was never trained to read, so that needs
  the fallback asked for by name.

  Args:
    benchmark: an `evaluation.questions.Benchmark`.
    template: the tokenizer's chat template, or None.
    fallback_allowed: the harness's --chat_template=plain.
    tokenizer_name: for the message (the tokenizer file or checkpoint).

  Raises:
    ValueError: no template, a multi-turn question, and no fallback asked for.
  """
  if template:
    return CHAT_TEMPLATE
  multi_turn = sum(1 for q in benchmark.questions if len(q.turns) > 1)
  if multi_turn and not fallback_allowed:
    raise ValueError(
        f"{tokenizer_name} has no chat template (none in tokenizer_config.json or "
        f"chat_template.jinja beside it), and benchmark {benchmark.name!r} has {multi_turn} "
        f"multi-turn question(s) of {len(benchmark.questions)}: a later turn must carry the "
        "earlier turns and answers in the model's chat format. --chat_template=plain uses "
        f"{PLAIN_DESCRIPTION} instead; or use a tokenizer with a chat template "
        "(--chat_template=auto, the default, requires one for multi-turn inputs)")
  return PLAIN
