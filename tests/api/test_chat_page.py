"""The built-in chat page in real headless Chromium (Debian's, driven by Playwright)."""

import os
import shutil

import pytest

from tests.factories import Server
from tests.require import missing

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def page(tmp_path):
    if not os.path.exists(CHROMIUM):
        missing("chromium", "Debian's chromium is not installed (make test installs it)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        yield page
        browser.close()


def test_chat_page_streams_and_stops(server: Server, page, tmp_path) -> None:
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('kv').textContent.includes('%')")
    assert page.text_content("#model") == "kvserve-demo-random"
    page.fill("#max_tokens", "24")
    page.fill("#input", "Hello there")
    page.press("#input", "Enter")
    page.wait_for_function(
        "document.querySelectorAll('.assistant').length === 1 && document.getElementById('send').disabled === false",
        timeout=30000,
    )
    reply = page.text_content(".assistant")
    assert reply and len(reply) > 0
    assert page.text_content(".user") == "Hello there"
    assert page.text_content("#ttft").endswith("ms")
    assert float(page.text_content("#tps")) > 0
    page.screenshot(path=str(tmp_path / "chat.png"))
    # a long answer, stopped from the page: the request is aborted on the server
    page.fill("#max_tokens", "4000")
    page.fill("#temperature", "1.0")
    page.fill("#input", "Tell me everything")
    page.press("#input", "Enter")
    page.wait_for_function(
        "document.querySelectorAll('.assistant')[1].textContent.length > 20", timeout=30000
    )
    page.click("#stop")
    page.wait_for_function("document.getElementById('send').disabled === false", timeout=10000)
    assert server.wait_idle()["kv_cache"]["blocks_used"] == 0
    assert not page.query_selector(".error")


def test_a_failed_turn_shows_its_error_and_leaves_the_history(server: Server, page) -> None:
    """A request the server refuses (max_tokens over the context) shows the error where
    the reply would be, with no empty bubble, and the next turn does not resend it."""
    sent = []
    page.on(
        "request",
        lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None,
    )
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('kv').textContent.includes('%')")
    page.fill("#max_tokens", "999999")
    page.fill("#input", "This one fails")
    page.press("#input", "Enter")
    page.wait_for_selector(".error", timeout=30000)
    assert "max" in page.text_content(".error").lower()
    assert page.query_selector_all(".assistant") == []  # the error took the bubble's place
    page.fill("#max_tokens", "8")
    page.fill("#input", "This one works")
    page.press("#input", "Enter")
    page.wait_for_function(
        "document.querySelectorAll('.assistant').length === 1 && document.getElementById('send').disabled === false",
        timeout=30000,
    )
    assert [m["content"] for m in sent[-1]["messages"]] == ["This one works"]
