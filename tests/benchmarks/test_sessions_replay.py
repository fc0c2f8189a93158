"""Real clients' recorded sessions (benchmarks/data/sessions: Claude Code, Codex, opencode and pi running real
tools in vLLM's source tree) replayed on a `--kv-reuse shift` server whose window they outgrow: every
turn is answered, the default policy clears in batches (never on two turns in a row), and every
clearing edit reuses the held K/V (issue 39: on Codex's Responses turns every shift edit fell back
with ``held_mismatch``)."""

from __future__ import annotations

import pytest

from agentkv.benchmarks.session_record import DATA, load
from agentkv.benchmarks.sessions import replay, wide_model

from conftest import API_KEY, start_server

WINDOW = 65536    # what the bench replays at: the fixed part is a third of it, a turn adds up to 8%
TURNS = 18


@pytest.fixture(scope="module")
def shift_server(tmp_path_factory):
    path, _ = wide_model(1)   # a 1-layer random model whose positions reach the window
    srv = start_server(tmp_path_factory.mktemp("replay-home"), "--model", path, "--served-model-name", "agentkv-tiny",
                       "--kv-reuse", "shift", "--max-model-len", str(WINDOW))
    yield srv
    srv.stop()


@pytest.mark.parametrize("name", ["codex-0.171.0", "claude-code-2.1.332", "opencode-1.18.33", "pi-0.73.1"])
def test_a_real_client_session_clears_in_batches_and_reuses_its_kv(shift_server, name):
    requests = load(DATA / f"{name}.json.xz")["requests"][:TURNS]
    rows = replay(shift_server.base_url, API_KEY, requests, 0, "agentkv-tiny", 0, 0)
    assert [r["status"] for r in rows] == [200] * TURNS, [r.get("error") for r in rows]
    assert all(r["prompt_tokens"] < WINDOW for r in rows)
    edited = [r["turn"] for r in rows if "clear_tool_uses" in r["edits"]]
    assert edited, [r["prompt_tokens"] for r in rows]
    assert all(b - a > 1 for a, b in zip(edited, edited[1:])), edited
    for r in rows:
        for kv in r["kv"]:
            assert kv.get("fallback") is None and kv["reused_tokens"] > 0, (r["turn"], kv)
            assert r["cached_tokens"] >= kv["reused_tokens"], r          # not computed again
