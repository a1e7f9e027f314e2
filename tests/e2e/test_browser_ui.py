"""The page at `/` in a real browser (headless Chromium through selenium and Debian's
chromium-driver: `make browser`) against real servers: it loads with no console errors, a
question streams an answer equal to the API's greedy answer, Stop aborts the request on the
server (its KV blocks come back), reasoning is folded above the answer, Markdown renders, and a
reply containing <script> is shown as text, never run; with --api-key the page asks for the key.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from scripts import headless_browser
from scripts.scripted_model import save_scripted_model
from scripts.server_process import ServerProcess
from scripts.soak import kv_settled, metric

API_KEY = "page-test-key"
REASONING = "Weighing it up."
SCRIPT = f"<think>{REASONING}</think>Try **this**: <script>pwned=1</script> now"
MARKERS = ("<think>", "</think>", "<script>", "</script>")
QUESTION = "What is the capital of France?"
# The default model's greedy story loops until its 3,000 tokens: the request cannot end by
# itself around the Stop click.
LONG_QUESTION = "Write a very long story about a dragon."
LONG_MAX_TOKENS = 3000


@pytest.fixture(scope="module")
def browser():
    if not headless_browser.available():
        message = "needs chromium and chromedriver (make browser installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    driver = headless_browser.chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def plain_server(default_model):
    srv = ServerProcess(default_model, "--num-kv-blocks", "256")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    model = save_scripted_model(tmp_path_factory.mktemp("page") / "model", SCRIPT, MARKERS)
    srv = ServerProcess(model, "--num-kv-blocks", "64", "--served-model-name", "scripted",
                        "--reasoning-parser", "deepseek_r1", "--api-key", API_KEY)
    yield srv
    assert srv.stop() == 0, srv.output()


def wait(driver, condition, timeout: float = 60.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def set_field(driver, element_id: str, value: str) -> None:
    field = css(driver, f"#{element_id}")[0]
    field.clear()
    field.send_keys(value)


def open_page(driver, url: str) -> None:
    driver.get(url)
    wait(driver, lambda d: css(d, "#model option"))


def ask(driver, question: str, max_tokens: int) -> None:
    set_field(driver, "temperature", "0")
    set_field(driver, "max-tokens", str(max_tokens))
    set_field(driver, "prompt", question)
    css(driver, "#send")[0].click()


def last_answer(driver):
    return css(driver, ".message.assistant")[-1]


def finished(driver) -> bool:
    return bool(css(driver, ".message.assistant .regenerate"))


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_a_question_streams_the_apis_greedy_answer(browser, plain_server):
    open_page(browser, plain_server.base_url)
    ask(browser, QUESTION, 40)
    wait(browser, finished)
    shown = last_answer(browser).find_element("css selector", ".answer").text
    model = httpx.get(f"{plain_server.base_url}/v1/models").json()["data"][0]["id"]
    api = httpx.post(f"{plain_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 40, "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert shown.split() == api.split()  # the same words (Markdown lays out the whitespace)
    stats = last_answer(browser).find_element("css selector", ".stats .summary").text
    assert "tok/s" in stats and "prompt tokens cached" in stats
    assert console_errors(browser) == []


def test_stop_aborts_the_request_on_the_server(browser, plain_server):
    url = plain_server.base_url
    assert kv_settled(url)["kv_blocks_free"] == metric(url, "deepinfer_kv_blocks_total")
    before = metric(url, "deepinfer_engine_generation_tokens_total")
    open_page(browser, url)
    ask(browser, LONG_QUESTION, LONG_MAX_TOKENS)
    # Streamed: words are shown while the request still runs (Stop is up).
    wait(browser, lambda d: len(last_answer(d).text.split()) > 10
         and css(d, "#stop")[0].is_displayed())
    css(browser, "#stop")[0].click()
    settled = kv_settled(url)
    assert settled["kv_blocks_free"] == settled["kv_blocks_total"]  # its blocks came back
    assert metric(url, "deepinfer_requests_in_flight") == 0
    generated = metric(url, "deepinfer_engine_generation_tokens_total") - before
    assert generated < LONG_MAX_TOKENS  # ended by the Stop, not by its length
    time.sleep(0.5)
    assert metric(url, "deepinfer_engine_generation_tokens_total") - before == generated
    wait(browser, finished)
    assert last_answer(browser).find_element("css selector", ".summary").text == "stopped"
    assert css(browser, "#send")[0].is_displayed()
    assert console_errors(browser) == []


def test_the_server_view_shows_the_servers_metrics(browser, plain_server):
    url = plain_server.base_url
    settled = kv_settled(url)  # idle: nothing runs, every block free
    open_page(browser, url)
    css(browser, "#tab-server")[0].click()
    assert not css(browser, "#server-view")[0].get_attribute("hidden")
    wait(browser, lambda d: css(d, '.card[data-metric="kv-device"]'))

    def card(name: str) -> str:
        return css(browser, f'.card[data-metric="{name}"] .value')[0].text

    total = int(settled["kv_blocks_total"])
    assert card("running") == "0" and card("waiting") == "0"
    assert card("kv-device") == f"0.0 % (0 of {total} blocks)"
    hit_rate = metric(url, "deepinfer_prefix_cache_hit_rate")
    assert card("hit-rate").startswith(f"{100 * hit_rate:.1f} % overall")
    assert card("tok-s").endswith("tok/s")
    assert card("audit") == "0 re-runs, no divergence"  # --audit-rate off
    assert console_errors(browser) == []


def test_reasoning_markdown_and_script_as_text_behind_an_api_key(browser, scripted_server):
    browser.execute_script("sessionStorage.clear()")
    browser.get(scripted_server.base_url)
    dialog = wait(browser, lambda d: [x for x in css(d, "#api-key-dialog") if x.is_displayed()])
    set_field(browser, "api-key-input", API_KEY)
    css(browser, "#api-key-save")[0].click()
    wait(browser, lambda d: css(d, "#model option"))
    assert not dialog[0].is_displayed()
    ask(browser, "Anything?", 30)
    wait(browser, finished)
    turn = last_answer(browser)
    reasoning = turn.find_element("css selector", "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    assert reasoning.get_property("textContent") == f"Reasoning{REASONING}"
    answer = turn.find_element("css selector", ".answer")
    assert answer.find_element("css selector", "strong").text == "this"
    assert answer.text == "Try this: <script>pwned=1</script> now"
    assert answer.find_elements("css selector", "script") == []
    assert browser.execute_script("return window.pwned") is None
    assert browser.execute_script("return sessionStorage.length") == 1  # the key, in this tab
    # The 401 of the first /v1/models (before the key) is the only error the console shows.
    errors = console_errors(browser)
    assert all("401" in e["message"] for e in errors), errors
