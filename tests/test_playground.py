"""The playground page that `gpt2 serve` serves at /, driven in a real browser: Debian's chromium and chromedriver
through selenium (no browser is downloaded). A screenshot of each state is saved under .cache/artifacts/."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from conftest import ARTIFACTS, needs_chromium
from conftest import wait_for
from test_serve import live

from gpt2_engine import GPT2
from gpt2_engine.serve.metrics import parse

pytestmark = [needs_chromium, pytest.mark.slow]  # make test-fast leaves it out


@pytest.fixture(scope="module")
def site(trained_model: GPT2):
    with live(trained_model, parallel=2, max_queue=8) as (url, engine):
        yield url, engine


def fill(browser, **fields: str | bool) -> None:
    for name, value in fields.items():
        element = browser.find_element("id", name)
        if isinstance(value, bool):
            if element.is_selected() != value:
                element.click()
        else:
            element.clear()
            element.send_keys(value)


def generate(browser, finished: tuple[str, ...] = ("length", "stop", "done")) -> str:
    browser.find_element("id", "generate").click()
    deadline = time.monotonic() + 60
    while browser.find_element("id", "stats").get_attribute("data-state") not in finished:
        assert time.monotonic() < deadline, browser.find_element("id", "error").text or "generation did not finish"
        time.sleep(0.05)  # polling the page, not timing anything
    return browser.execute_script("return document.getElementById('output').textContent")


def screenshot(browser, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / name))


def test_generate_streams_the_greedy_completion(browser, site) -> None:
    url, _ = site
    browser.get(url + "/")
    fill(browser, prompt="The default value of", max_tokens="12", temperature="0", colour=False)
    text = generate(browser)
    api = httpx.post(f"{url}/v1/completions", json={"model": "gpt2", "prompt": "The default value of", "max_tokens": 12,
                                                    "temperature": 0}, timeout=60).json()["choices"][0]["text"]
    assert text == api and text
    stats = browser.find_element("id", "stats").text
    assert "tokens/s" in stats and "time to first token" in stats and " tokens · " in stats
    screenshot(browser, "playground-generate.png")
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []  # the page and its icon load with no error in the console


def test_stop_aborts_and_frees_the_slot(browser, site) -> None:
    url, engine = site
    browser.get(url + "/")
    fill(browser, prompt="The", max_tokens="400", temperature="0", ignore_eos=True)
    browser.find_element("id", "generate").click()
    wait_for(lambda: len(browser.execute_script("return document.getElementById('output').textContent")) > 5,
             "streamed text")
    assert parse(httpx.get(f"{url}/metrics").text)["gpt2_requests_running"] == 1
    browser.find_element("id", "stop_button").click()
    wait_for(lambda: browser.find_element("id", "stats").get_attribute("data-state") == "stopped", "the stopped state")
    wait_for(lambda: parse(httpx.get(f"{url}/metrics").text)["gpt2_requests_running"] == 0, "the slot to be freed")
    assert engine.loop.scheduler.running == 0


def test_colour_by_probability_uses_gltr_buckets(browser, site) -> None:
    url, _ = site
    browser.get(url + "/")
    prompt = "The default value of the argument is"
    fill(browser, prompt=prompt, max_tokens="6", temperature="0", ignore_eos=False, colour=True)
    generate(browser)
    spans = browser.find_elements("css selector", "#output .tok")
    ref = httpx.post(f"{url}/v1/completions", json={"model": "gpt2", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                   "echo": True, "logprobs": 5}, timeout=60).json()["choices"][0]
    ranks = ref["logprobs"]["token_ranks"]
    assert [s.get_attribute("textContent") for s in spans] == ref["logprobs"]["tokens"]
    for span, rank in zip(spans, ranks):
        expected = "" if rank is None else "top10" if rank <= 10 else "top100" if rank <= 100 else "top1000" if rank <= 1000 else "beyond"
        classes = span.get_attribute("class").split()
        assert (expected in classes) if expected else not {"top10", "top100", "top1000", "beyond"} & set(classes)
        assert span.get_attribute("data-rank") == ("" if rank is None else str(rank))
    assert any(r is not None and r > 10 for r in ranks), "the probe should show more than one bucket"
    assert all("top10" in s.get_attribute("class") for s in spans[-6:])  # greedy picks rank 1
    assert "rank" in spans[-1].get_attribute("title") and "top 5" in spans[-1].get_attribute("title")
    assert browser.find_element("id", "legend").is_displayed()
    screenshot(browser, "playground-colour.png")


def test_server_errors_are_shown_in_the_page(browser, site) -> None:
    url, _ = site
    browser.get(url + "/")
    # the form's own checks (min/max) stop what they can; this one only the server knows: the model's context
    fill(browser, prompt="x", max_tokens="600", temperature="1", colour=False)
    browser.find_element("id", "generate").click()
    wait_for(lambda: browser.find_element("id", "error").text != "", "the error message")
    assert "exceeds the context of 512 tokens" in browser.find_element("id", "error").text
    assert browser.find_element("id", "generate").is_enabled()


def test_api_key_field(browser, trained_model: GPT2) -> None:
    with live(trained_model, parallel=1, max_queue=2, api_key="s3cret") as (url, _):
        browser.get(url + "/")
        fill(browser, prompt="The", max_tokens="3", temperature="0", colour=False)
        browser.find_element("id", "generate").click()
        wait_for(lambda: browser.find_element("id", "error").text != "", "the 401 message")
        assert "invalid or missing API key" in browser.find_element("id", "error").text
        browser.find_element("css selector", "details.key summary").click()
        fill(browser, api_key="s3cret")
        assert generate(browser) != ""


def test_labels_keyboard_and_a_narrow_window(browser, site) -> None:
    url, _ = site
    browser.get(url + "/")
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input, textarea')].filter(e => !document.querySelector(`label[for=${e.id}]`))"
        ".map(e => e.id)")
    assert unlabelled == []
    from selenium.webdriver.common.keys import Keys

    fill(browser, prompt="The file", max_tokens="4", temperature="0", ignore_eos=False, colour=False)
    browser.find_element("id", "generate").send_keys(Keys.ENTER)  # keyboard only
    wait_for(lambda: browser.find_element("id", "stats").get_attribute("data-state") in ("length", "stop"), "generation")
    browser.set_window_size(380, 900)
    assert browser.execute_script("return document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    screenshot(browser, "playground-narrow.png")
    browser.set_window_size(1100, 1000)


def test_the_steering_slider_steers_an_sae_feature(browser, trained_model: GPT2, saes_dir: Path) -> None:
    """With `--sae NAME=DIR`, the page lists the SAE and its slider adds (or clamps) a feature: the text is the API's
    with the same steering, and differs from the unsteered text."""
    from gpt2_engine import SAE
    from gpt2_engine.interp.steering import SteeringRegistry
    from gpt2_engine.serve.app import ServerSettings

    import torch

    sae = SAE.load(saes_dir / "topk-mlp")
    ids = torch.tensor([trained_model.tokenizer.encode("The default value of the file")])
    _, cache = trained_model.run_with_cache_with_saes(ids, [sae], names=[f"{sae.hook_name}.hook_sae_acts_post"])
    feature = int(cache[f"{sae.hook_name}.hook_sae_acts_post"].reshape(-1, sae.d_sae).amax(0).argmax())  # one that fires
    settings = ServerSettings(steering=SteeringRegistry(saes={"mlp": sae}))
    with live(trained_model, parallel=2, max_queue=4, settings=settings) as (url, _):
        browser.get(url + "/")
        wait_for(lambda: browser.find_element("id", "steering").is_displayed(), "the steering section")
        assert "mlp (blocks.2.hook_mlp_out" in browser.find_element("id", "steer_sae").text
        # past <|endoftext|>: a fixture trained on an AMX Xeon ends this text after 6 tokens, which the slider's +100
        # leaves as they are
        fill(browser, prompt="The default value of", max_tokens="12", temperature="0", colour=False, ignore_eos=True,
             steer_feature=str(feature))
        browser.execute_script("const r = document.getElementById('steer_coef'); r.value = '100';"
                               "r.dispatchEvent(new Event('input'));")
        assert browser.find_element("id", "steer_coef_value").text == "100"
        text = generate(browser)
        ask = {"model": "gpt2", "prompt": "The default value of", "max_tokens": 12, "temperature": 0,
               "ignore_eos": True}
        steered = httpx.post(f"{url}/v1/completions", timeout=60, json={
            **ask, "steering": [{"sae": "mlp", "feature": feature, "coef": 100}]}).json()["choices"][0]["text"]
        plain = httpx.post(f"{url}/v1/completions", json=ask, timeout=60).json()["choices"][0]["text"]
        assert text == steered != plain
        screenshot(browser, "playground-steering.png")
