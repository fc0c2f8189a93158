"""The session recorder with the real pinned clients: each runs against our scripted upstream in a
small source tree, runs the scripted tools itself, and every main-loop request is recorded (what
`agentkv bench sessions --record` does to make benchmarks/data/sessions)."""

from __future__ import annotations

import json

import pytest

from agentkv.benchmarks.session_record import CLIENTS, load, record

STEPS = [("bash", "ls"), ("read", "pkg/cache.py"), ("bash", "grep -n 'def ' pkg/cache.py")]


@pytest.mark.parametrize("client", ["claude-code", "codex"])
def test_a_client_runs_the_scripted_tools_for_real_and_its_requests_are_recorded(client, tmp_path):
    if not (CLIENTS / "node_modules" / ".bin" / ("claude" if client == "claude-code" else "codex")).exists():
        pytest.skip("the npm test clients are missing: npm ci --prefix tests/clients")
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "cache.py").write_text("def lookup_block_hash(key):\n    return KEY_7319\n")
    (tmp_path / "home").mkdir()
    doc = load(record(client, tree, tmp_path / "home", tmp_path / "out", steps=STEPS))
    requests = doc["requests"]
    assert doc["client"] == client and len(requests) == len(STEPS) + 1
    last = json.dumps(requests[-1]["body"])
    assert "cache.py" in last and "KEY_7319" in last and "lookup_block_hash" in last   # real tool output
    for earlier, later in zip(requests, requests[1:]):   # each turn extends the conversation
        assert len(json.dumps(later["body"])) > len(json.dumps(earlier["body"]))
