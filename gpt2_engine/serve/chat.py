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

import json
import queue
import re
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..core.config import read_bytes
from ..core.errors import GPT2EngineError, InputError, one_line

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
    """A compiled template, the stop strings that end the assistant's turn, and where it came from. An operator's
    template (`isolated`) renders in bounded child processes (Renderers below); the engine's own in this process."""

    def __init__(self, text: str, stops: tuple[str, ...], source: str, isolated: bool = False) -> None:
        self.text, self.stops, self.source, self.isolated = text, stops, source, isolated
        # an operator's template is compiled and rendered only in its renderers (bounded), never in this process
        self.template = None if isolated else compile_template(text, source)
        self.renderers = Renderers(text, source) if isolated else None

    def __reduce__(self) -> tuple:
        # a compiled template does not pickle, and Ray ships the server's settings to its replicas: send the text
        return ChatTemplate, (self.text, self.stops, self.source, self.isolated)

    def render(self, messages: list[dict[str, str]], eos_token: str) -> str:
        """The prompt for `messages` ({"role", "content"} each), ending where the assistant's reply begins. Blocks
        for at most RENDER_SECONDS (plus the wait for a free renderer) on an isolated template."""
        if self.renderers is None:
            return self.render_here(messages, eos_token)
        return self.renderers.render(messages, eos_token)

    def render_here(self, messages: list[dict[str, str]], eos_token: str) -> str:
        """render() in this process, unbounded but by the sandbox (the engine's own template, and in a renderer)."""
        assert self.template is not None, "an isolated template renders in its renderers"
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=eos_token,
                                        eos_token=eos_token)
        except RaisedByTemplate as e:
            raise ChatTemplateError(one_line(e, 500)) from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template ({self.source}) failed: {one_line(e, 300)}") from None
        except (RecursionError, OverflowError, MemoryError) as e:
            raise TemplateFailed(f"the server's chat template ({self.source}) failed: {type(e).__name__}"
                                 f"{': ' + str(e) if str(e) else ''}") from None

    def close(self) -> None:
        """Stop the renderers (the server's shutdown)."""
        if self.renderers is not None:
            self.renderers.close()


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


class GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks the assistant's text for its training masks
    (return_assistant_tokens_mask): here its body renders as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def compile_template(source: str, name: str) -> jinja2.Template:
    """A template in the sandbox transformers renders chat templates in: no file or attribute access beyond data."""
    # optimized=False: no constant folding while compiling, where '{{ "x"|center(1500000000) }}' in a branch never
    # taken would be evaluated, unbounded (the sandbox's checks apply when a template runs, not when it compiles)
    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationTag],
                     optimized=False)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{name}: not a Jinja chat template (line {e.lineno}: {e.message})") from None
    except (SyntaxError, RecursionError, OverflowError, MemoryError) as e:  # what Python makes of Jinja's code
        raise ChatTemplateError(f"{name}: the chat template does not compile ({type(e).__name__})") from None


def plain_template() -> ChatTemplate:
    return ChatTemplate(PLAIN_TEMPLATE, PLAIN_STOPS, "the plain template")


JSON_OBJECT = re.compile(r'\s*\{\s*"')  # a JSON object's start: no Jinja text starts so ({{ "x" }} is "{{")
TEMPLATE_BYTES = 1 << 20  # a chat template file (transformers' largest are a few KB; a tokenizer_config.json more)


def load_template(path: Path) -> ChatTemplate:
    """A chat template file: the Jinja text itself, or a tokenizer_config.json that holds one as "chat_template"."""
    try:
        text = read_bytes(path, TEMPLATE_BYTES, "a chat template (a Jinja text or a tokenizer_config.json)",
                          regular=True).decode("utf-8")
    except InputError as e:
        raise ChatTemplateError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path}: cannot read the chat template ({e.__class__.__name__}: {e})") from None
    if path.suffix.lower() == ".json" or JSON_OBJECT.match(text):  # a tokenizer_config.json by any name
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise ChatTemplateError(f"{path}: expected a JSON object with a \"chat_template\" string") from None
        if not isinstance(text, str):
            raise ChatTemplateError(f"{path}: \"chat_template\" must be one template string (named templates are "
                                    "not supported)")
    if not text.strip():
        raise ChatTemplateError(f"{path}: the chat template is empty (every conversation would render to nothing)")
    trial_render(text, str(path))  # first, in a bounded child: compiling folds constants, which can take memory
    return ChatTemplate(text, (), str(path), isolated=True)


# An operator's template renders in child processes, each with 1 GiB of address space over the interpreter's own
# and RENDER_SECONDS a conversation: a template that loops, recurses or doubles a string on some conversation fails
# that request (a 500 naming the template) and costs the server nothing else. A child that overruns is killed and a
# new one started; each dies with the server (PR_SET_PDEATHSIG), whatever it is rendering. A child imports this file
# and jinja2 only (the package's __init__ files, which import torch, are skipped), and says when it is ready, so its
# start-up (a tenth of a second) is never counted in a render's time.
WORKER = """
import ctypes, json, resource, signal, sys, types
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
root = json.loads(sys.argv[1])
for name in ("gpt2_engine", "gpt2_engine.core", "gpt2_engine.serve"):
    package = types.ModuleType(name)
    package.__path__ = [root + "/" + name.replace(".", "/")]
    sys.modules[name] = package
from gpt2_engine.serve.chat import ChatTemplate, ChatTemplateError, TemplateFailed
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()  # the interpreter's own mappings
resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), used + (1 << 30)))
text, source = json.loads(sys.stdin.readline())
print(json.dumps({"ready": True}), flush=True)
template = None
for line in sys.stdin:
    messages, eos = json.loads(line)
    try:
        template = template or ChatTemplate(text, (), source)
        reply = {"prompt": template.render_here(messages, eos)}
    except TemplateFailed as e:
        reply = {"failed": str(e)}
    except ChatTemplateError as e:
        reply = {"refused": str(e)}
    print(json.dumps(reply), flush=True)
"""
RENDER_SECONDS = 2.0  # a conversation's render; transformers' templates take milliseconds
RENDERERS = 2  # child processes (the machines have 2 cores); a request waits for a free one
WAIT_SECONDS = 10.0
START_SECONDS = 30.0  # a renderer's start-up, on a machine busy with the model (it takes a tenth of a second idle)
RENDER_BYTES = 2 << 20  # a rendered prompt: GPT-2's context is 1,024 tokens, and a request body at most 1 MiB by default


class Renderers:
    """Child processes that render one template (WORKER), handed to one render at a time. They start with the
    server; one that fails a render (over time, over memory, dead) is replaced at once, one whose template refused a
    conversation (raise_exception: the client's error) keeps serving."""

    def __init__(self, text: str, source: str, count: int = RENDERERS, seconds: float = RENDER_SECONDS) -> None:
        self.text, self.source, self.seconds, self.count = text, source, seconds, count
        self.idle: queue.Queue[subprocess.Popen | None] = queue.Queue()
        self.children: set[subprocess.Popen] = set()
        self.ready: set[subprocess.Popen] = set()
        self.closed = False
        for _ in range(count):
            self.idle.put(self._start())

    def render(self, messages: list[dict[str, str]], eos_token: str) -> str:
        name = f"the server's chat template ({self.source})"
        try:
            child = None if self.closed else self.idle.get(timeout=WAIT_SECONDS)
        except queue.Empty:
            raise TemplateFailed(f"{name} is busy: its {len(self.children)} renderers were at work for over "
                                 f"{WAIT_SECONDS:.0f} s") from None
        if self.closed:
            raise TemplateFailed(f"{name} cannot render: the server is stopping")
        try:
            if child is None or child.poll() is not None:
                self._stop(child)
                child = self._start()
            self._wait_ready(child, name)
            reply = self._ask(child, messages, eos_token)
        except TemplateFailed:
            self._stop(child)
            child = None
            raise
        except ChatTemplateError:  # refused: the child answered, and renders the next conversation as well
            raise
        except BaseException:
            self._stop(child)
            child = None
            raise
        finally:
            self.idle.put(child if child is not None or self.closed else self._replacement())
        return reply

    def _replacement(self) -> subprocess.Popen | None:
        """A child started now, so that the next render finds it ready; None (started at that render) if the machine
        cannot start one now."""
        try:
            return self._start()
        except OSError:
            return None

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parent.parent.parent)
        child = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(root)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.children.add(child)
        child.stdin.write((json.dumps([self.text, self.source]) + "\n").encode())
        child.stdin.flush()
        return child

    def _wait_ready(self, child: subprocess.Popen, name: str) -> None:
        """Return once `child` has started (at once after its first time); TemplateFailed if it does not."""
        if child in self.ready:
            return
        if not select.select([child.stdout], [], [], START_SECONDS)[0]:
            raise TemplateFailed(f"{name} failed: its renderer did not start in {START_SECONDS:g} s")
        if child.stdout.readline(256) != b'{"ready": true}\n':
            raise TemplateFailed(f"{name} failed: its renderer exited as it started")
        self.ready.add(child)

    def _ask(self, child: subprocess.Popen, messages: list[dict[str, str]], eos_token: str) -> str:
        """The child's render of `messages`; TemplateFailed when it takes over `seconds`, renders more than
        RENDER_BYTES or dies, ChatTemplateError when the template refuses the conversation."""
        name = f"the server's chat template ({self.source})"
        try:
            child.stdin.write((json.dumps([messages, eos_token]) + "\n").encode())
            child.stdin.flush()
        except OSError:  # it died between two renders (the machine's OOM killer)
            raise TemplateFailed(f"{name} failed: its renderer exited") from None
        if not select.select([child.stdout], [], [], self.seconds)[0]:
            raise TemplateFailed(f"{name} took over {self.seconds:g} s")
        line = child.stdout.readline(RENDER_BYTES * 2)  # JSON escapes may double the text
        if not line:  # killed (the machine's OOM killer), or stopped with the server
            raise TemplateFailed(f"{name} failed: its renderer exited")
        reply = json.loads(line) if line.endswith(b"\n") else {}
        if "prompt" not in reply and "failed" not in reply and "refused" not in reply or \
                len(reply.get("prompt", "")) > RENDER_BYTES:  # characters: at least as many bytes
            raise TemplateFailed(f"{name} rendered more than {RENDER_BYTES >> 20} MiB")
        if "failed" in reply:
            raise TemplateFailed(reply["failed"])  # and the child goes: what it allocated goes with it
        if "refused" in reply:
            raise ChatTemplateError(reply["refused"])
        return reply["prompt"]

    def _stop(self, child: subprocess.Popen | None) -> None:
        if child is not None:
            child.kill()
            child.wait()
            self.children.discard(child)
            self.ready.discard(child)

    def close(self) -> None:
        """Stop every renderer: a render under way fails at once (its child gone), and one waiting for a renderer
        too (the server is stopping)."""
        self.closed = True
        for child in list(self.children):
            self._stop(child)
        for _ in range(self.count):
            self.idle.put(None)  # wakes the renders waiting for a renderer


TRIAL_SECONDS = 30


def trial_render(text: str, source: str) -> None:
    """ChatTemplateError if the template fails on a one-message conversation, or takes more than 1 GiB or
    TRIAL_SECONDS to render it (in a renderer of its own, as every request's render: see WORKER)."""
    renderers = Renderers(text, source, count=1, seconds=TRIAL_SECONDS)
    try:
        renderers.render([{"role": "user", "content": "Hello"}], "<|endoftext|>")
    except ChatTemplateError as e:
        message = str(e).replace(f"took over {TRIAL_SECONDS} s", f"took over {TRIAL_SECONDS} s to render a "
                                 "one-message conversation")
        raise ChatTemplateError(message if message.startswith(source) else f"{source}: {message}") from None
    finally:
        renderers.close()
