"""Stored data: session ids cannot name anything outside the caller's own namespace (no path
characters, no other key's sessions), and one key's sessions are invisible to another."""

from __future__ import annotations

import os

import pytest

from conftest import OTHER_KEY

MODEL = "agentkv-tiny"
BAD_IDS = ["../../etc/passwd", "..", ".", "a/b", "a\\b", "x" * 129, "sp ace", "nul\x00", "%2e%2e%2f", "é"]


def _chat(server, key=None, session=None, text="hello", header=True):
    http = server.http(**({"api_key": key} if key else {}))
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    headers = {}
    if session is not None:
        if header:
            headers["X-Session-Id"] = session
        else:
            body["session_id"] = session
    return http.post("/v1/chat/completions", json=body, headers=headers)


def _tree(root) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files}


@pytest.mark.parametrize("bad", BAD_IDS)
def test_path_like_session_ids_are_refused(server, bad):
    before = _tree(server.home.parent)
    if bad.isascii() and "\x00" not in bad:  # header values must be ASCII without NUL
        r = _chat(server, session=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    r = _chat(server, session=bad, header=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    from urllib.parse import quote

    r = server.http().get(f"/v1/sessions/{quote(bad, safe='')}")
    assert r.status_code in (400, 404), r.text          # refused, or no such route: never a file
    new = _tree(server.home.parent) - before
    assert all(p.startswith(str(server.home)) for p in new), new


def test_one_keys_sessions_are_invisible_to_another(server):
    sid = "isolation-check"
    assert _chat(server, session=sid, text="secret for A: 4417").status_code == 200
    mine = server.http().get(f"/v1/sessions/{sid}")
    assert mine.status_code == 200 and mine.json()["messages"] == 1
    assert "4417" in server.http().get(f"/v1/sessions/{sid}/messages").json()["data"][0]["content"]
    theirs = server.http(api_key=OTHER_KEY).get(f"/v1/sessions/{sid}")
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "session_not_found"
    assert server.http(api_key=OTHER_KEY).get(f"/v1/sessions/{sid}/messages").status_code == 404
    # the same id under the other key is a different session: A's log is untouched
    assert _chat(server, key=OTHER_KEY, session=sid, text="B writes here").status_code == 200
    b = server.http(api_key=OTHER_KEY).get(f"/v1/sessions/{sid}/messages").json()["data"]
    assert [m["content"] for m in b] == ["B writes here"]
    a = server.http().get(f"/v1/sessions/{sid}/messages").json()["data"]
    assert [m["content"] for m in a] == ["secret for A: 4417"]
