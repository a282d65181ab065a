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

import jinja2
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


def compile_template(source: str, name: str) -> jinja2.Template:
    """A template in the sandbox transformers renders chat templates in: no file or attribute access beyond data."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{name}: not a Jinja chat template (line {e.lineno}: {e.message})") from None


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
    return ChatTemplate(text, (), str(path))
