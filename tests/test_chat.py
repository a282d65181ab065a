"""/v1/chat/completions on a real `gpt2 serve`, through the `openai` client's chat.completions.create unchanged: the
conversation rendered by the plain template (or a --chat-template file) and continued exactly as the same prompt
through the completions path; and the server's leniency toward what OpenAI clients send (unknown fields, a body
without a JSON Content-Type, max_completion_tokens), and a busy port refused before the model loads."""

from __future__ import annotations

import json
import re
import logging
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_serve import live

from gpt2_engine import GPT2
from gpt2_engine.serve.app import ServerSettings
from gpt2_engine.serve.chat import (PLAIN_TEMPLATE, ChatTemplate, ChatTemplateError, Renderers, TemplateFailed,
                                    load_template, plain_template)

openai = pytest.importorskip("openai", reason="the openai client is part of the test extra")

CONVERSATION = [{"role": "system", "content": "Answers from the docs."},
                {"role": "user", "content": "What does it return?"},
                {"role": "assistant", "content": "The value."},
                {"role": "user", "content": "Return the"}]
RENDERED = ("Answers from the docs.\n\nUser: What does it return?\nAssistant: The value.\nUser: Return the\n"
            "Assistant:")


@pytest.fixture(scope="module")
def server(trained_server: str) -> str:
    return trained_server  # the session's one server (conftest.py)


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def expected(model: GPT2, prompt: str, **kwargs):
    return model.complete([prompt], allow_special=True, stop=["\nUser:"], **kwargs)[0]


def test_the_plain_template_renders_a_transcript() -> None:
    assert plain_template().render(CONVERSATION, "<|endoftext|>") == RENDERED
    assert plain_template().render([{"role": "developer", "content": "Be brief."}], "") == "Be brief.\n\nAssistant:"


def test_greedy_chat_equals_the_completion_of_the_rendered_conversation(client, trained_model: GPT2) -> None:
    out = client.chat.completions.create(model="gpt2", messages=CONVERSATION, max_tokens=24, temperature=0)
    want = expected(trained_model, RENDERED, max_new_tokens=24, temperature=0)
    assert out.choices[0].message.content == want.text.lstrip() != ""
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert out.usage.prompt_tokens == len(trained_model.tokenizer.encode(RENDERED))
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == "gpt2"


def test_tokenize_takes_a_conversation_as_chat_renders_it(server: str, trained_model: GPT2) -> None:
    """POST /tokenize with messages (vLLM's form): the ids of the prompt /v1/chat/completions continues."""
    with httpx.Client(base_url=server, timeout=30) as c:
        r = c.post("/tokenize", json={"messages": CONVERSATION})
        assert r.status_code == 200 and r.json()["tokens"] == trained_model.tokenizer.encode(RENDERED), r.text
        for body in ({"messages": CONVERSATION, "prompt": "x"}, {}, {"messages": []}):
            r = c.post("/tokenize", json=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_without_max_tokens_a_reply_runs_to_its_end_of_turn_or_the_context(client, trained_model: GPT2) -> None:
    out = client.chat.completions.create(model="gpt2", messages=CONVERSATION, temperature=0)
    prompt = len(trained_model.tokenizer.encode(RENDERED))
    want = expected(trained_model, RENDERED, max_new_tokens=512 - prompt + 1, temperature=0)
    assert out.choices[0].message.content == want.text.lstrip()
    assert out.usage.completion_tokens == len(want.token_ids) <= 512 - prompt + 1


def test_streamed_chat_joins_to_the_whole_reply(client) -> None:
    kwargs = dict(model="gpt2", messages=CONVERSATION, max_completion_tokens=30, temperature=0.9, seed=3, n=2)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[i].message.content
        assert mine[-1].finish_reason == whole.choices[i].finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])
    assert whole.choices[0].message.content != whole.choices[1].message.content  # each choice its own seed
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stop_and_logprobs(client, trained_model: GPT2) -> None:
    out = client.chat.completions.create(model="gpt2", messages=CONVERSATION, max_tokens=20, temperature=0,
                                         logprobs=True, top_logprobs=3, stop=[" the"])
    want = trained_model.complete([RENDERED], allow_special=True, stop=["\nUser:", " the"], max_new_tokens=20,
                                  temperature=0)[0]
    choice = out.choices[0]
    assert choice.message.content == want.text.lstrip()
    content = choice.logprobs.content
    ids = [t for t in want.token_ids if t != trained_model.tokenizer.eot_id]
    assert len(content) == len(ids) == out.usage.completion_tokens  # a stop string's tokens included, as everywhere
    assert [c.token for c in content] == [trained_model.tokenizer.token_text(t) for t in ids]
    assert [bytes(c.bytes) for c in content] == [trained_model.tokenizer.token_bytes(t) for t in ids]
    assert [c.logprob for c in content] == pytest.approx(want.logprobs[:len(content)], abs=1e-5)
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6  # greedy: the top one


@pytest.mark.parametrize("body,param,fragment", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "only text parts"),
    ({"messages": [{"role": "user", "content": []}]}, "messages", "expected a string or at least one text part"),
    ({"messages": CONVERSATION, "logprobs": "yes"}, "logprobs", 'logprobs: expected true or false, got "yes"'),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     "a text part's \"text\" must be a string, got NoneType"),
    ({"messages": CONVERSATION, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tool calling is not supported"),
    ({"messages": CONVERSATION, "response_format": {"type": "xml"}}, "response_format",
     "response_format type must be text, json_object or json_schema, got 'xml'"),
    ({"messages": CONVERSATION, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"messages": CONVERSATION, "max_tokens": 600}, "max_tokens", "asking for 600 new tokens exceeds the context"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "prompt", "exceeds the context of 512 tokens"),
    ({"messages": CONVERSATION, "model": "gpt-4o"}, "model", "does not exist"),
])
def test_bad_chat_requests_get_openai_shaped_errors(server: str, body: dict, param: str, fragment: str) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert "--truncate" not in err["message"]


def test_unknown_fields_are_ignored_and_logged(trained_model: GPT2, caplog: pytest.LogCaptureFixture) -> None:
    with live(trained_model) as (url, _), caplog.at_level(logging.WARNING, logger="gpt2_engine.serve.app"):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "The", "max_tokens": 3, "temperature": 0,
                                                      "frobnicate": 1, "store": False}, timeout=60)
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 3,
                                                               "temperature": 0, "metadata": {"a": "b"}}, timeout=60)
        many = httpx.post(f"{url}/v1/completions", timeout=60, json={  # a log line is not the client's to fill
            "prompt": "The", "max_tokens": 1, **{f"k{i}" + "x" * (100 if i == 0 else 0): i for i in range(10_000)}})
    assert r.status_code == 200 and chat.status_code == 200 and many.status_code == 200
    assert r.json()["choices"][0]["text"] == trained_model.generate("The", max_new_tokens=3, temperature=0)
    assert "/v1/completions: ignoring 2 unknown field(s): 'frobnicate', 'store'" in caplog.messages
    assert "/v1/chat/completions: ignoring 1 unknown field(s): 'metadata'" in caplog.messages
    assert (f"/v1/completions: ignoring 10000 unknown field(s): 'k0{'x' * 38}...', 'k1', 'k10', 'k100', 'k1000' and "
            "9,995 more") in caplog.messages


def test_max_completion_tokens_and_a_body_without_json_content_type(server: str, trained_model: GPT2) -> None:
    body = {"prompt": "Return the", "max_completion_tokens": 5, "temperature": 0, "ignore_eos": True}
    # curl -d sends application/x-www-form-urlencoded; the body is JSON all the same
    r = httpx.post(f"{server}/v1/completions", content=json.dumps(body),
                   headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == trained_model.generate("Return the", max_new_tokens=5, temperature=0,
                                                                          ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == 5
    bare = httpx.post(f"{server}/v1/completions", content=json.dumps(body).encode(), timeout=60)
    assert bare.status_code == 200 and bare.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + eos_token + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_chat_template_file_in_transformers_form(trained_model: GPT2, tmp_path: Path) -> None:
    (tmp_path / "chat.jinja").write_text(CHATML)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "x"}))
    for path in (tmp_path / "chat.jinja", tmp_path / "tokenizer_config.json"):
        template = load_template(path)
        rendered = template.render(CONVERSATION[:2], "<|endoftext|>")
        assert rendered == ("<|im_start|>system\nAnswers from the docs.<|endoftext|>\n<|im_start|>user\nWhat does it "
                            "return?<|endoftext|>\n<|im_start|>assistant\n")
        with live(trained_model, settings=ServerSettings(chat_template=template)) as (url, _):
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CONVERSATION[:2], "max_tokens": 8,
                                                               "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        ids = trained_model.tokenizer.encode(rendered, allow_special=True)
        assert ids.count(trained_model.tokenizer.eot_id) == 2  # the template's eos_token is the special token
        want = trained_model.complete([ids], max_new_tokens=8, temperature=0)[0]
        assert r.json()["choices"][0]["message"]["content"] == want.text.lstrip()


def test_a_template_that_raises_is_a_400_and_a_broken_file_a_one_line_error(trained_model: GPT2, trained_dir: Path,
                                                                             tmp_path: Path) -> None:
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start "
                          "with a user message') }}{% endif %}{{ messages[0]['content'] }}", (), "strict")
    with live(trained_model, settings=ServerSettings(chat_template=strict)) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CONVERSATION}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "messages: Conversations must start with a user message",
                                 "type": "invalid_request_error", "param": "messages", "code": None}
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match=r"bad.jinja: not a Jinja chat template \(line 1: Unexpected end"):
        load_template(tmp_path / "bad.jinja")
    proc = subprocess.run([sys.executable, "-m", "gpt2_engine", "serve", "--chat-template", str(tmp_path / "bad.jinja"),
                           "--weights", str(trained_dir), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"gpt2 serve: error: {tmp_path / 'bad.jinja'}: not a Jinja chat template (line 1:")
    assert len(proc.stderr.strip().splitlines()) == 1


SLOW_ON_SOME = ("{%- for m in messages %}{% if m['content'] == 'slow' %}{% for i in range(100000) %}{% for j in "
                "range(100000) %}{% endfor %}{% endfor %}{% elif m['content'] == 'big' %}{% set s = namespace(x='ab') "
                "%}{% for i in range(40) %}{% set s.x = s.x ~ s.x %}{% endfor %}{% endif %}{{ m['content'] }}"
                "{% endfor %}")


def test_a_template_that_overruns_on_some_conversations_fails_those_requests_alone(tiny_model: GPT2,
                                                                                 tmp_path: Path) -> None:
    """An operator's template renders in bounded child processes: one that loops for hours, or doubles a string past
    1 GiB, on some content (its startup trial passes) fails that request, and every other request is served
    (it hung every later chat request, pinned a core, and blocked the server's shutdown)."""
    import concurrent.futures

    (tmp_path / "t.jinja").write_text(SLOW_ON_SOME)
    template = load_template(tmp_path / "t.jinja")
    source = tmp_path / "t.jinja"
    with live(tiny_model, settings=ServerSettings(chat_template=template)) as (url, _):
        def chat(content: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 2})

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            slow = [pool.submit(chat, "slow") for _ in range(3)]  # one more than the renderers: it waits its turn
            assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              timeout=60).status_code == 200
            replies = [f.result() for f in slow]
        for r in replies:
            assert r.status_code == 500 and r.json()["error"] == {
                "message": f"the server's chat template ({source}) took over 2 s", "type": "server_error",
                "param": None, "code": "chat_template_failed"}, r.text
        assert chat("hi").status_code == 200
        children = list(template.renderers.children)
        assert children and all(c.poll() is None for c in children)
    assert all(c.poll() is not None for c in children)  # the server's shutdown stops them
    renderers = Renderers(SLOW_ON_SOME, "t.jinja", count=1, seconds=120)  # time enough to reach the memory bound
    with pytest.raises(TemplateFailed, match=r"^the server's chat template \(t.jinja\) failed: MemoryError$"):
        renderers.render([{"role": "user", "content": "big"}], "")
    assert renderers.render([{"role": "user", "content": "hi"}], "") == "hi"  # in a new child: the old one is gone
    renderers.close()


def test_an_operators_template_never_compiles_or_renders_in_the_server(tiny_model: GPT2, tmp_path: Path) -> None:
    """Compiling folded constants in the server, unbounded ('x'|center(1500000000) in a branch never taken: 3.2 GB
    at startup), and a 15 MB render tokenized on the event loop (a greedy completion waited 15 s): the template is
    compiled and rendered in its renderers only, a render past 2 MiB is refused, and the tokenizing runs off the
    event loop."""
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{% if m.content == 'never' %}{{ 'x'|center(1500000000) }}"
                                      "{% elif m.content == 'long' %}{% for i in range(3000) %}{{ 'y' * 1000 }}"
                                      "{% endfor %}{% endif %}{{ m.content }}{% endfor %}")
    template = load_template(tmp_path / "t.jinja")
    assert template.template is None  # nothing compiled here
    with live(tiny_model, settings=ServerSettings(chat_template=template)) as (url, _):
        r = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "long"}]}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["message"] == (
            f"the server's chat template ({tmp_path / 't.jinja'}) rendered more than 2 MiB"), r.text[:300]
        r = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] == tiny_model.tokenizer.encode("hi"), r.text[:300]


def test_closing_the_renderers_ends_the_renders_under_way(tmp_path: Path) -> None:
    """The server's stop closes them: a render stuck in a loop fails at once (it had run to the grace timeout,
    then the server printed tracebacks and plain-text 500s), and one that asks after that is told why."""
    import concurrent.futures

    renderers = Renderers(SLOW_ON_SOME, "t.jinja", count=1, seconds=600)
    assert renderers.render([{"role": "user", "content": "hi"}], "") == "hi"  # its child is up
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(renderers.render, [{"role": "user", "content": "slow"}], "")
        with pytest.raises(concurrent.futures.TimeoutError):
            stuck.result(timeout=0.5)  # at work (for hours, were it left to finish)
        renderers.close()
        with pytest.raises(TemplateFailed, match=r"^the server's chat template \(t.jinja\) failed: its renderer "
                                                 r"exited$"):
            stuck.result(timeout=60)
    with pytest.raises(TemplateFailed, match=r"cannot render: the server is stopping$"):
        renderers.render([{"role": "user", "content": "hi"}], "")


ROLES = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user message') }}"
         "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_a_refused_conversation_keeps_its_renderer_and_a_start_is_not_a_renders_time() -> None:
    """A refused render (raise_exception: the client's 400) killed its renderer, and the new one's start (1.5 s,
    importing torch) was counted in the next render's 2 s: two refused requests beside four good ones gave all four a
    false 500 "took over 2 s". A refusal keeps its renderer; renderers start with the server, import jinja2 and the
    template code only, and say when they are ready, before a render's time starts."""
    import concurrent.futures

    renderers = Renderers(ROLES, "roles.jinja", count=2, seconds=0.5)  # a render takes a millisecond
    started = {c.pid for c in renderers.children}
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(renderers.render, [{"role": role, "content": "hi"}], "")
                       for role in ["assistant", "assistant", "user", "user", "user", "user"]]
            outcomes = [f.exception() or f.result() for f in futures]
        assert [type(o).__name__ if isinstance(o, Exception) else o for o in outcomes] == [
            "ChatTemplateError", "ChatTemplateError", "hi", "hi", "hi", "hi"]
        assert str(outcomes[0]) == "Conversations must start with a user message"
        assert {c.pid for c in renderers.children} == started  # the same two processes served all six
        assert not any("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in started)
    finally:
        renderers.close()


def test_a_template_file_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    """A FIFO as --chat-template waited for a writer forever."""
    import os

    os.mkfifo(tmp_path / "t.jinja")
    with pytest.raises(ChatTemplateError, match=r"t.jinja: not a regular file \(a FIFO, a device or a folder\); "
                                                r"expected a chat template \(a Jinja text or a tokenizer_config.json\)$"):
        load_template(tmp_path / "t.jinja")


def test_a_tokenizer_config_by_any_name_an_empty_template_and_transformers_generation_tag(tmp_path: Path) -> None:
    """The thirteenth attack: a tokenizer_config.json named TC.JSON (or anything not ending in .json) was rendered as
    Jinja text, every prompt starting '{"chat_template": "'; "chat_template": "" rendered every conversation to
    nothing; transformers' {% generation %} (assistant masks for training) was "not a Jinja chat template"."""
    for name in ("TC.JSON", "tokenizer_config"):
        (tmp_path / name).write_text(json.dumps({"chat_template": CHATML, "eos_token": "x"}))
        assert load_template(tmp_path / name).render(CONVERSATION[:1], "<|endoftext|>").startswith("<|im_start|>system")
    for name, text in (("empty.json", json.dumps({"chat_template": ""})), ("blank.jinja", " \n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ChatTemplateError, match=rf"^{re.escape(str(tmp_path / name))}: the chat template is empty "
                                                    r"\(every conversation would render to nothing\)$"):
            load_template(tmp_path / name)
    tagged = CHATML.replace("{{ '<|im_start|>' + m['role']", "{% generation %}{{ '<|im_start|>' + m['role']").replace(
        "eos_token + '\\n' }}", "eos_token + '\\n' }}{% endgeneration %}")
    assert tagged != CHATML
    (tmp_path / "tagged.jinja").write_text(tagged)
    (tmp_path / "plain.jinja").write_text(CHATML)
    assert load_template(tmp_path / "tagged.jinja").render(CONVERSATION, "<|endoftext|>") == \
        load_template(tmp_path / "plain.jinja").render(CONVERSATION, "<|endoftext|>")


def test_the_plain_template_pickles_as_its_text() -> None:
    import pickle

    again = pickle.loads(pickle.dumps(plain_template()))
    assert again.text == PLAIN_TEMPLATE and again.render(CONVERSATION, "") == RENDERED


def test_a_busy_port_is_refused_before_the_model_loads(trained_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "gpt2_engine", "serve", "--weights", str(trained_dir), "--port",
                               str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (f"gpt2 serve: error: --port {port}: 127.0.0.1:{port} is already in use (another "
                           "server?); stop it or choose another --port\n")
