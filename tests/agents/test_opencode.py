"""The real opencode (pinned in tests/clients/package.json) against agentkv with its defaults: the
OpenAI-compatible provider on chat completions, two turns (``--continue``), both in the session log
under opencode's own session id (its ``x-session-id`` header)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import API_KEY, REPO

OPENCODE = REPO / "tests" / "clients" / "node_modules" / "opencode-linux-x64" / "bin" / "opencode"
pytestmark = pytest.mark.skipif(not OPENCODE.exists(),
                                reason="opencode is not installed (npm ci --prefix tests/clients)")


def opencode(server, home: Path, work: Path, *args: str) -> list[dict]:
    config = home / "opencode.json"
    config.write_text(json.dumps({"$schema": "https://opencode.ai/config.json", "provider": {"agentkv": {
        "npm": "@ai-sdk/openai-compatible", "name": "agentkv",
        "options": {"baseURL": f"{server.base_url}/v1", "apiKey": API_KEY},
        "models": {"agentkv-tiny": {"name": "agentkv-tiny", "limit": {"context": 200000, "output": 256}}}}}}))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "OPENCODE_CONFIG": str(config),
           "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    run = subprocess.run(["timeout", "600", str(OPENCODE), "run", "-m", "agentkv/agentkv-tiny", "--format", "json",
                          *args], cwd=work, env=env, capture_output=True, text=True, timeout=660)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n--- server ---\n{server.log_tail(40)}"
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_opencode_two_turns_with_its_defaults(wide_server, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    first = opencode(wide_server, home, work, "Say hi.")
    second = opencode(wide_server, home, work, "--continue", "Say it again.")
    sessions = {e.get("sessionID") for e in first + second if e.get("sessionID")}
    assert len(sessions) == 1, sessions                                   # one opencode session, two turns
    assert not [e for e in first + second if e.get("type") == "error"], first + second
    r = wide_server.http().get(f"/v1/sessions/{sessions.pop()}/messages")
    assert r.status_code == 200, r.text
    log = r.json()["data"]
    systems = [m["content"] for m in log if m["role"] == "system"]
    assert any("title generator" in s for s in systems) and any("You are opencode" in s for s in systems)
    texts = json.dumps([m for m in log if m["role"] == "user"])
    # its title request shares the session id: a branch of its own, each turn's message logged once per branch
    assert texts.count("Say hi.") == 2 and texts.count("Say it again.") == 1
