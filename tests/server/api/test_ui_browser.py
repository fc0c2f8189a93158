"""The sessions page (/ui) in a real browser: Debian's Chromium driven by Playwright for Python,
against a real `agentkv serve`. A session with a clear and a summary shows both, turn by turn, with
its log beside the view the model got; another key's session is not reachable (neither its page
nor its data); a message holding HTML and script renders as text. Where no browser is installed
the tests skip with the reason, except under `.ci/run` (AGENTKV_REQUIRE_BROWSER=1), where that
is a failure."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import httpx
import pytest

from conftest import API_KEY, OTHER_KEY

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MARKUP = "<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\"><b>not bold</b>"


@pytest.fixture(scope="module")
def browser():
    why = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        why = f"Playwright for Python is not installed ({exc})"
    if why is None and CHROMIUM is None:
        why = "no Chromium here (Debian: apt-get install chromium; .ci/chromium)"
    if why is not None:
        if os.environ.get("AGENTKV_REQUIRE_BROWSER", "0") != "0":
            pytest.fail(f"the browser tests must run here: {why}")
        pytest.skip(why)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


def _turns(n: int) -> list[dict]:
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": MARKUP}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": f'{{"n": {i}}}'}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": f"probe {i}: " + "latency ok " * 60}]
    return msgs


@pytest.fixture(scope="module")
def session_with_a_clear_and_a_summary(server) -> str:
    """A session of API_KEY's: a turn that clears two tool results, then one that summarizes."""
    sid = f"ui-{uuid.uuid4().hex[:8]}"
    clear = {"edits": [{"type": "clear_tool_uses", "trigger": 0, "keep": 1}]}
    compact = {"edits": [{"type": "compact", "trigger": 0, "keep_recent_tokens": 200, "summary_max_tokens": 16}]}
    for msgs, cm in ((_turns(3), clear), (_turns(5) + [{"role": "user", "content": "and now?"}], compact)):
        r = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
            "model": "agentkv-tiny", "messages": msgs, "max_tokens": 2, "context_management": cm})
        assert r.status_code == 200, r.text
    edits = [e["type"] for e in r.json()["context_management"]["applied_edits"]]
    assert "compact" in edits, r.json()["context_management"]
    deadline = time.monotonic() + 30                                       # turn records are written after the answer
    while len(server.http().get(f"/ui/api/sessions/{sid}").json().get("turns", [])) < 2:
        assert time.monotonic() < deadline, "the session's two turn records were not written"
        time.sleep(0.2)
    return sid


def _sign_in(context, server, key: str):
    page = context.new_page()
    page.goto(f"{server.base_url}/ui")
    assert page.url.endswith("/ui/login")                                  # no key yet: sent to sign in
    page.fill("#key", key)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.base_url}/ui")
    return page


def test_a_session_with_a_clear_and_a_summary_shows_them(browser, server, session_with_a_clear_and_a_summary,
                                                        tmp_path):
    sid = session_with_a_clear_and_a_summary
    context = browser.new_context()
    page = _sign_in(context, server, API_KEY)
    cookie = next(c for c in context.cookies() if c["name"] == "agentkv_ui")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and API_KEY not in cookie["value"]
    page.click(f"a:text-is('{sid}')")
    page.wait_for_url(f"**/ui/sessions/{sid}")
    rows = page.locator("tr.turn")
    assert rows.count() == 2
    first, second = rows.nth(0).inner_text(), rows.nth(1).inner_text()
    assert "clear_tool_uses" in first and "cleared tool uses 2" in first
    assert "compact" in second and "summarized messages" in second
    assert page.locator("tr.turn >> nth=1 >> details summary").inner_text() == "the summary"
    assert page.locator("svg.chart polyline.prompt").count() == 1
    assert page.locator("svg.chart circle.computed").count() == 2
    log, view = page.locator("#log .msg"), page.locator("#view .msg")
    assert log.count() == len(_turns(5)) + 1                               # the whole log, as sent
    assert page.locator("#log .tag.summarized").count() >= 1               # what the summary replaced, marked
    assert page.locator("#view .tag.summary").count() == 1                 # the view holds the summary instead
    assert view.count() < log.count()
    page.screenshot(path=str(tmp_path / "session.png"), full_page=True)
    context.close()


def test_html_and_script_in_a_message_render_as_text(browser, server, session_with_a_clear_and_a_summary):
    context = browser.new_context()
    page = _sign_in(context, server, API_KEY)
    page.goto(f"{server.base_url}/ui/sessions/{session_with_a_clear_and_a_summary}")
    first_user = page.locator("#log .msg").nth(1).locator("pre")
    assert first_user.inner_text() == MARKUP                               # shown as the text it is
    assert page.evaluate("document.querySelectorAll('script, img, b').length") == 0
    assert page.evaluate("window.__pwned") is None
    context.close()


def test_another_keys_session_is_not_reachable(browser, server, session_with_a_clear_and_a_summary):
    sid = session_with_a_clear_and_a_summary
    context = browser.new_context()
    page = _sign_in(context, server, OTHER_KEY)
    assert sid not in page.content()                                       # not in its list
    r = page.goto(f"{server.base_url}/ui/sessions/{sid}")
    assert r.status == 404 and "no such session" in page.content()
    data = page.request.get(f"{server.base_url}/ui/api/sessions/{sid}")   # the page's data, with its cookie
    assert data.status == 404 and data.json()["error"]["code"] == "session_not_found"
    listing = page.request.get(f"{server.base_url}/ui/api/sessions").json()["data"]
    assert sid not in [s["id"] for s in listing]
    context.close()


def test_the_api_key_header_works_on_ui_as_on_the_api(server, session_with_a_clear_and_a_summary):
    sid = session_with_a_clear_and_a_summary
    ok = server.http().get(f"/ui/api/sessions/{sid}")
    assert ok.status_code == 200 and [t["n"] for t in ok.json()["turns"]] == [1, 2]
    assert ok.headers["cache-control"] == "no-store"
    assert server.http(api_key=OTHER_KEY).get(f"/ui/api/sessions/{sid}").status_code == 404
    anonymous = httpx.get(f"{server.base_url}/ui/api/sessions/{sid}")
    assert anonymous.status_code == 401
    page = httpx.get(f"{server.base_url}/ui", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"] == "/ui/login"
    forged = httpx.get(f"{server.base_url}/ui/api/sessions", cookies={"agentkv_ui": "local.9999999999.deadbeef"})
    assert forged.status_code == 401
    bad = httpx.post(f"{server.base_url}/ui/login", data={"key": "wrong"}, follow_redirects=False)
    assert bad.status_code == 401 and "not one of this server" in bad.text
    assert json.loads(server.http().get("/v1/models").text)["data"][0]["agentkv"]["tool_calls"] is True


def test_the_page_can_be_turned_off(no_connector_server):
    """``--no-ui`` (the no-connector test server runs with it): nothing under /ui."""
    assert no_connector_server.http().get("/ui").status_code == 404
    assert no_connector_server.http().get("/ui/api/sessions").status_code == 404
