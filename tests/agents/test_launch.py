"""`agentkv launch CLIENT -- ARGS` with the pinned real clients (tests/clients/package.json): against a
server whose window fits the client, the client runs and answers through agentkv; against the
default server (SmolLM2, 8,192 tokens), Claude Code, Codex and opencode are refused at once with
the reason and what to serve instead (pi's first request is small: it is started). In every case
no file of the user's home is changed, added or removed: each client's configuration lives in its
environment and a temporary folder of its own."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import API_KEY, REPO

PINNED = REPO / "tests" / "clients" / "node_modules"
pytestmark = pytest.mark.skipif(not (PINNED / ".bin" / "claude").exists(),
                                reason="the pinned clients are not installed (npm ci --prefix tests/clients)")
ARGS = {"claude": ["-p", "Say hi.", "--max-turns", "2", "--output-format", "json"],
        "codex": ["exec", "--skip-git-repo-check", "--json", "Say hi."],
        "opencode": ["run", "--format", "json", "Say hi."],
        "pi": ["-p", "Say hi.", "--mode", "json"]}


@pytest.fixture
def home(tmp_path) -> Path:
    """A user's home with each client's own config in it, and a project folder to work in."""
    home = tmp_path / "home"
    for path, text in {".claude.json": '{"userID": "mine"}', ".claude/settings.json": '{"theme": "dark"}',
                       ".codex/config.toml": 'model = "gpt-5"\n', ".config/opencode/opencode.json": '{"theme": "x"}',
                       ".pi/agent/models.json": '{"providers": {}}', "work/README.md": "a project\n"}.items():
        (home / path).parent.mkdir(parents=True, exist_ok=True)
        (home / path).write_text(text)
    return home


def snapshot(home: Path) -> dict[str, str]:
    return {str(p.relative_to(home)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in home.rglob("*") if p.is_file()}


def launch(home: Path, client: str, url: str, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}
    return subprocess.run([sys.executable, "-m", "agentkv.server.cli", "launch", client, "--url", url,
                           "--api-key", API_KEY, "--", *args], cwd=home / "work", env=env, capture_output=True,
                          text=True, timeout=900, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("client", ["claude", "codex", "opencode", "pi"])
def test_a_client_launched_against_a_window_that_fits_answers_through_agentkv(wide_server, home, client):
    before = snapshot(home)
    run = launch(home, client, wide_server.base_url, *ARGS[client])
    assert run.returncode == 0, f"{run.stderr[-3000:]}\n{run.stdout[-3000:]}"
    assert f"against {wide_server.base_url}" in run.stderr and "window 200,000" in run.stderr
    out = run.stdout
    if client == "claude":
        result = json.loads(out.strip().splitlines()[-1])
        assert result["type"] == "result" and not result["is_error"] and result["usage"]["input_tokens"] > 1000
    else:
        assert any(json.loads(line).get("type") in ("turn.completed", "step_finish", "agent_end")
                   for line in out.splitlines() if line.startswith("{"))
    assert snapshot(home) == before                       # nothing of the user's changed, added or removed
    time.sleep(0.5)
    turns = wide_server.http().get("/ui/api/sessions").json()["data"]
    assert turns and time.time() - max(s["last_turn"] for s in turns) < 600   # it went through agentkv


@pytest.mark.parametrize("client", ["claude", "codex", "opencode"])
def test_the_default_server_is_refused_at_once_with_the_reason(real_server, home, client):
    """SmolLM2's 8,192 tokens: the client's first request alone nearly fills it. Nothing starts."""
    before = snapshot(home)
    t0 = time.monotonic()
    run = launch(home, client, real_server.base_url, *ARGS[client])
    assert run.returncode == 2 and time.monotonic() - t0 < 30, run.stderr
    said = run.stderr
    assert "cannot work with this server: its first request alone is about" in said
    assert "smollm2-135m-instruct's window is 8,192 tokens" in said
    assert "--max-model-len 131072" in said and "--tool-call-parser" in said   # what to serve instead
    assert run.stdout == "" and snapshot(home) == before


def test_no_server_and_no_key_are_said_plainly(wide_server, home):
    run = launch(home, "claude", "http://127.0.0.1:9", *ARGS["claude"])
    assert run.returncode == 2 and "no agentkv server answers at http://127.0.0.1:9" in run.stderr
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    run = subprocess.run([sys.executable, "-m", "agentkv.server.cli", "launch", "claude", "--url",
                          wide_server.base_url], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "wants one of its API keys" in run.stderr
    run = subprocess.run([sys.executable, "-m", "agentkv.server.cli", "launch", "claude", "--url",
                          wide_server.base_url, "--api-key", "sk-not-one-of-its"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "refused the API key given" in run.stderr
