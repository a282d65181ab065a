"""`gpt2 inspect`: the files it writes (PNGs, self-contained HTML, JSON), its errors, and the HTML page in a real
browser (Debian's chromium; a screenshot goes to .cache/artifacts/inspect.png for a person to look at)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import ARTIFACTS, needs_chromium

from gpt2_engine import GPT2
from gpt2_engine.cli import main

PROMPT = "Return a new file object, and close the file when done."
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def written(trained_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("inspect")
    assert main(["inspect", PROMPT, "--target", " the", "--layers", "0,2-3", "--out", str(out), "--quiet",
                 "--weights", str(trained_dir)]) == 0
    return out


def test_inspect_writes_pictures_html_and_json(written: Path, trained_model: GPT2) -> None:
    names = sorted(p.name for p in written.iterdir())
    assert names == ["attention.png", "attribution.png", "dla.png", "head_scores.png", "logit_lens.png", "report.html",
                     "report.json"]
    for png in written.glob("*.png"):
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, png.name
    report = json.loads((written / "report.json").read_text())
    ids = trained_model.tokenizer.encode(PROMPT)
    assert report["ids"] == ids and len(report["tokens"]) == len(ids)
    target = trained_model.tokenizer.encode(" the")[0]
    assert report["target"] | {"logprob": None} == {"id": target, "text": " the", "chosen": "given", "logprob": None,
                                                    "rank": report["target"]["rank"]}
    assert report["attention"]["layers"] == [0, 2, 3]
    assert len(report["attention"]["patterns"]) == 3 and len(report["attention"]["patterns"][0]) == 4  # layers, heads
    dla = report["dla"]
    assert abs(sum(dla["values"]) - (dla["logit"] - dla["ln_f_bias_term"])) < 1e-3
    ig = report["attribution"]
    gap = ig["logprob"] - ig["baseline_logprob"]
    assert abs(sum(ig["integrated_gradients"]) - gap) <= max(0.011 * abs(gap), 2e-3)
    assert set(report["head_scores"]) == {"previous_token", "duplicate_token", "induction"}


def test_the_html_is_self_contained(written: Path) -> None:
    html = (written / "report.html").read_text()
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", html)  # nothing loaded from anywhere
    assert "http://" not in html and "https://" not in html
    inline = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', html, re.S).group(1)
    assert json.loads(inline) == json.loads((written / "report.json").read_text())


def test_inspect_json_to_stdout(capsys, trained_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "inspect", "Close the file.", "--json", "--weights", str(trained_dir))
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["target"]["chosen"] == "most likely next token" and report["target"]["rank"] == 1
    assert list(tmp_path.iterdir()) == []  # --json without --out writes no files


@pytest.mark.parametrize("args, message", [
    (["--target", " the file"], "--target ' the file' is 2 tokens"),
    (["--layers", "7"], "--layers '7': this model's layers are 0..3"),
    (["--layers", "one"], "--layers 'one': expected 'all' or a list like '0,3,5-7'"),
    (["--layers", "0,3-1"], "--layers '0,3-1': the range 3-1 runs backwards; expected LOW-HIGH"),
    (["--ig-steps", "0"], "--ig-steps: expected an integer in [1, 1024], got 0"),
    (["--ig-steps", "1000000000"], "--ig-steps: expected an integer in [1, 1024], got 1000000000"),
])
def test_inspect_errors_are_one_line_and_exit_2(capsys, trained_dir: Path, tmp_path: Path, args: list[str], message: str) -> None:
    code, out, err = run(capsys, "inspect", PROMPT, *args, "--out", str(tmp_path / "o"), "--weights", str(trained_dir))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gpt2 inspect: error: ") and message in err, err


def test_inspect_refuses_an_empty_or_too_long_prompt(capsys, trained_dir: Path) -> None:
    code, _, err = run(capsys, "inspect", "", "--weights", str(trained_dir))
    assert code == 2 and "the prompt is empty" in err
    code, _, err = run(capsys, "inspect", " word" * 300, "--weights", str(trained_dir))
    assert code == 2 and "the prompt is 300 tokens; gpt2 inspect draws every token and takes at most 256" in err


@needs_chromium
def test_the_html_page_renders_and_hovers_show_values(written: Path, browser) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    report = json.loads((written / "report.json").read_text())
    browser.set_window_size(1200, 2400)
    browser.get((written / "report.html").as_uri())
    tip = browser.find_element(By.ID, "tip")
    lens_rows = browser.find_elements(By.CSS_SELECTOR, "#lens tr")
    assert len(lens_rows) == 1 + 5  # the token header, embed and 4 blocks
    last = lens_rows[-1].find_elements(By.TAG_NAME, "td")[-1]
    assert last.text == report["logit_lens"]["top_tokens"][-1][-1][0]
    ActionChains(browser).move_to_element(last).perform()
    top = report["logit_lens"]["top_tokens"][-1][-1]
    assert tip.is_displayed() and tip.text.startswith("block 3, after") and json.dumps(top[1])[1:-1] in tip.text
    tokens = browser.find_elements(By.CSS_SELECTOR, "#attribution .tok")
    assert len(tokens) == len(report["tokens"])
    ActionChains(browser).move_to_element(tokens[2]).perform()
    shown = re.search(r"integrated_gradients: (\S+)", tip.text)
    assert tip.text.startswith(f'token 2 "{report["tokens"][2]}"') and shown, tip.text
    assert float(shown.group(1)) == pytest.approx(report["attribution"]["integrated_gradients"][2], rel=1e-3)
    canvas = browser.find_element(By.ID, "attention")
    assert canvas.size["width"] > 100
    dla_cells = browser.find_elements(By.CSS_SELECTOR, "#dla td")
    assert len(dla_cells) == 4 * 5  # layers x (heads + MLP)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "inspect.png"))
