"""Headless Chromium driven through selenium, from Debian's `chromium` and `chromium-driver`
(`make browser` installs them): for the page's tests and its screenshots."""

from __future__ import annotations

import shutil
from typing import Any

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def available() -> bool:
    return bool(CHROMIUM and CHROMEDRIVER)


def chromium(width: int = 1280, height: int = 900) -> Any:
    """A selenium WebDriver on a fresh headless Chromium that keeps the page's console log."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not available():
        raise RuntimeError("needs chromium and chromedriver (make browser installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
