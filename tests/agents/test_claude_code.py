"""The real Claude Code (pinned in tests/clients/package.json) against agentkv, unchanged: its
default tool set, two turns (`--continue`), both in the session log under its own session id."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import API_KEY, REPO

CLAUDE = REPO / "tests" / "clients" / "node_modules" / ".bin" / "claude"
pytestmark = pytest.mark.skipif(not CLAUDE.exists(),
                                reason="Claude Code is not installed (npm ci --prefix tests/clients)")


def claude(server, home: Path, work: Path, *args: str) -> dict:
    """One `claude -p` run; returns its final `result` event."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": server.base_url,
           "ANTHROPIC_API_KEY": API_KEY, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256"}
    run = subprocess.run(["timeout", "600", str(CLAUDE), *args, "--model", "agentkv-tiny", "--max-turns", "1",
                          "--output-format", "stream-json", "--verbose"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=660)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n--- server ---\n{server.log_tail(40)}"
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], result
    return result


def _texts(message: dict) -> str:
    c = message["content"]
    return c if isinstance(c, str) else " ".join(b.get("text") or "" for b in c or [] if isinstance(b, dict))


def test_claude_code_two_turns_with_its_default_tools(wide_server, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    first = claude(wide_server, home, work, "-p", "Say hi.")
    second = claude(wide_server, home, work, "-p", "Say it again.", "--continue")
    sid = first["session_id"]
    assert second["session_id"] == sid
    r = wide_server.http().get(f"/v1/sessions/{sid}/messages")
    assert r.status_code == 200, r.text
    log = r.json()["data"]
    users = [i for i, m in enumerate(log) if m["role"] == "user" and "Say hi." in _texts(m)]
    again = [i for i, m in enumerate(log) if m["role"] == "user" and "Say it again." in _texts(m)]
    assert len(users) == 1 and len(again) == 1 and users[0] < again[0]           # both turns, once each
    assert log[0]["role"] == "system" and "system" in [m["role"] for m in log[1:users[0] + 2]]
    assert [m["role"] for m in log[again[0] - 1:again[0]]] == ["assistant"]        # turn one's answer
    assert first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"] > 20_000   # 24 tools
    assert second["usage"]["cache_read_input_tokens"] > 20_000                     # the prefix cache held
