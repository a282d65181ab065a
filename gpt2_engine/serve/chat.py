"""Chat for a base model: a conversation rendered to one prompt by a chat template, in the Jinja form transformers uses.

GPT-2 was never trained on conversations, so it has no template of its own. The default below is a plain
transcript that a base model continues naturally (the generation prompt ends with "Assistant:", no trailing space,
because GPT-2's BPE puts the space in front of the next word), and the assistant's turn ends where the model starts
the user's next one ("\nUser:", a stop string the server adds). `gpt2 serve --chat-template FILE` takes any template
written for transformers' `apply_chat_template` (the variables `messages`, `add_generation_prompt`, `bos_token` and
`eos_token`, and `raise_exception`); such a template ends turns its own way, usually with `eos_token`, on which
generation stops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..core.errors import GPT2EngineError

PLAIN_TEMPLATE = """\
{%- for message in messages %}
    {%- if message['role'] in ('system', 'developer') %}
        {{- message['content'] + '\\n\\n' }}
    {%- elif message['role'] == 'user' %}
        {{- 'User: ' + message['content'] + '\\n' }}
    {%- elif message['role'] == 'assistant' %}
        {{- 'Assistant: ' + message['content'] + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- 'Assistant:' }}
{%- endif %}"""
PLAIN_STOPS = ("\nUser:",)


class ChatTemplateError(GPT2EngineError):
    """A chat template that does not compile, or that refused a conversation."""


class TemplateFailed(ChatTemplateError):
    """The operator's template itself failed (it recursed, ran past the sandbox's range, ran out of memory): a server
    error, not the client's."""


class RaisedByTemplate(Exception):
    """What a template's raise_exception("...") raises: its message is for the client."""


def raise_exception(message: str) -> None:
    raise RaisedByTemplate(message)


class ChatTemplate:
    """A compiled template, the stop strings that end the assistant's turn, and where it came from."""

    def __init__(self, text: str, stops: tuple[str, ...], source: str) -> None:
        self.text, self.stops, self.source = text, stops, source
        self.template = compile_template(text, source)

    def __reduce__(self) -> tuple:
        # a compiled template does not pickle, and Ray ships the server's settings to its replicas: send the text
        return ChatTemplate, (self.text, self.stops, self.source)

    def render(self, messages: list[dict[str, str]], eos_token: str) -> str:
        """The prompt for `messages` ({"role", "content"} each), ending where the assistant's reply begins."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=eos_token,
                                        eos_token=eos_token)
        except RaisedByTemplate as e:
            raise ChatTemplateError(str(e)) from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template ({self.source}) failed: {e}") from None
        except (RecursionError, OverflowError, MemoryError) as e:
            raise TemplateFailed(f"the server's chat template ({self.source}) failed: {type(e).__name__}"
                                 f"{': ' + str(e) if str(e) else ''}") from None


MAX_REPEAT = 1 << 20  # characters (or items) a template's `*` may make: a prompt is at most a few thousand tokens


class ChatSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with `*` on a string or a list bounded: Jinja folds 'x' * 4000000000 into a constant
    while it compiles, and at render time it is one allocation of that size. Intercepting the operator stops both."""

    intercepted_binops = frozenset({"*"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        sized = [v for v in (left, right) if isinstance(v, (str, list, tuple))]
        count = [v for v in (left, right) if isinstance(v, int)]
        if operator == "*" and sized and count and len(sized[0]) * count[0] > MAX_REPEAT:
            raise SecurityError(f"'*' would make {len(sized[0]) * count[0]:,} characters or items; at most "
                                f"{MAX_REPEAT:,}")
        return super().call_binop(context, operator, left, right)


def compile_template(source: str, name: str) -> jinja2.Template:
    """A template in the sandbox transformers renders chat templates in: no file or attribute access beyond data."""
    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{name}: not a Jinja chat template (line {e.lineno}: {e.message})") from None
    except (SyntaxError, RecursionError, OverflowError, MemoryError) as e:  # what Python makes of Jinja's code
        raise ChatTemplateError(f"{name}: the chat template does not compile ({type(e).__name__})") from None


def plain_template() -> ChatTemplate:
    return ChatTemplate(PLAIN_TEMPLATE, PLAIN_STOPS, "the plain template")


def load_template(path: Path) -> ChatTemplate:
    """A chat template file: the Jinja text itself, or a tokenizer_config.json that holds one as "chat_template"."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path}: cannot read the chat template ({e.__class__.__name__}: {e})") from None
    if path.suffix == ".json":
        import json

        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ChatTemplateError(f"{path}: expected a JSON object with a \"chat_template\" string") from None
        if not isinstance(text, str):
            raise ChatTemplateError(f"{path}: \"chat_template\" must be one template string (named templates are "
                                    "not supported)")
    trial_render(text, str(path))  # first, in a bounded child: compiling folds constants, which can take memory
    return ChatTemplate(text, (), str(path))


# A trial conversation, rendered once at startup in a child process with bounded memory and time: a template that
# fails whatever the conversation (a loop past the sandbox's range, endless recursion, a string doubled until memory
# runs out) is refused before the server starts, and cannot take the server's memory while it tries.
TRIAL = """
import json, resource, sys
sys.path[:0] = json.loads(sys.argv[1])
from gpt2_engine.serve.chat import ChatTemplate, ChatTemplateError
text, source = json.loads(sys.stdin.read())
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()  # the interpreter's own mappings
resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), used + (1 << 30)))  # and 1 GiB for the render
try:
    ChatTemplate(text, (), source).render([{"role": "user", "content": "Hello"}], "<|endoftext|>")
except ChatTemplateError as e:
    print(str(e))
"""
TRIAL_SECONDS = 30


def trial_render(text: str, source: str) -> None:
    """ChatTemplateError if the template fails on a one-message conversation, or takes more than 1 GiB or
    TRIAL_SECONDS to render it (in a child process; see TRIAL)."""
    import json
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent.parent)
    try:
        done = subprocess.run([sys.executable, "-c", TRIAL, json.dumps([root])], input=json.dumps([text, source]),
                              capture_output=True, text=True, timeout=TRIAL_SECONDS)
    except subprocess.TimeoutExpired:
        raise ChatTemplateError(f"{source}: rendering a one-message conversation took over {TRIAL_SECONDS} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ChatTemplateError(f"{source}: rendering a one-message conversation failed ({last[:200]})")
    if done.stdout.strip():
        message = done.stdout.strip().splitlines()[-1]
        raise ChatTemplateError(message if message.startswith(source) else f"{source}: {message}")
