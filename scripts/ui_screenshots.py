"""The README's pictures of the browser page: a chat answer and the server view under load,
taken from a real server on the default model in headless Chromium.

    .venv/bin/python scripts/ui_screenshots.py            # writes docs/ui-chat.png, ui-server.png
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # for scripts.*, after site-packages

import httpx  # noqa: E402

from scripts import headless_browser  # noqa: E402
from scripts.server_process import ServerProcess  # noqa: E402

SYSTEM = "You are a concise assistant for Python programmers."
QUESTION = "Write a Python function that reverses a string, with a short explanation."
LOAD = ["Write a very long story about a dragon.", "Tell me about the history of Rome.",
        "Explain how a CPU cache works.", "Describe a walk in the mountains."]


def load(url: str, model: str, seconds: float) -> None:
    """Streams from several clients at once for `seconds` (the server view's chart)."""
    deadline = time.monotonic() + seconds

    def client(question: str) -> None:
        while time.monotonic() < deadline:
            httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "max_tokens": 160, "temperature": 0.8, "messages": [
                    {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})

    threads = [threading.Thread(target=client, args=(q,)) for q in LOAD]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument("--load-seconds", type=float, default=45.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.model)
    driver = headless_browser.chromium(1280, 820)
    try:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        find = driver.find_element
        driver.get(server.base_url)
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
        find(By.ID, "system-prompt").send_keys(SYSTEM)
        for field, value in (("temperature", "0"), ("max-tokens", "200")):
            find(By.ID, field).clear()
            find(By.ID, field).send_keys(value)
        find(By.ID, "prompt").send_keys(QUESTION)
        find(By.ID, "send").click()
        WebDriverWait(driver, 120).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .regenerate"))
        driver.save_screenshot(str(args.out / "ui-chat.png"))
        find(By.ID, "tab-server").click()
        model = find(By.ID, "model").get_attribute("value")
        busy = threading.Thread(target=load, args=(server.base_url, model, args.load_seconds))
        busy.start()
        time.sleep(args.load_seconds - 5)  # taken under load: requests running, a full chart
        driver.save_screenshot(str(args.out / "ui-server.png"))
        busy.join()
    finally:
        driver.quit()
        server.stop()
    print(f"wrote {args.out / 'ui-chat.png'} and {args.out / 'ui-server.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
