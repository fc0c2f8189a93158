"""Real agent harnesses on the Responses API against the real server (the tiny model, 200k window):
Codex and pi, each in its own temporary home, two turns in one session, requests as they send them.
The tiny model writes noise; what is tested is the protocol: exit 0, each turn complete, and the
server's session log holding both turns as the client sent them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import API_KEY, REPO

BIN = REPO / "tests" / "clients" / "node_modules" / ".bin"
TURN_TIMEOUT_S = 900


@pytest.fixture(autouse=True)
def _clients_installed():
    """setup.sh installs them (npm ci --prefix tests/clients) where npm exists; CI must have them."""
    if not ((BIN / "codex").exists() and (BIN / "pi").exists()):
        if os.environ.get("CI"):
            pytest.fail("the npm test clients are missing: npm ci --prefix tests/clients")
        pytest.skip("the npm test clients are missing: npm ci --prefix tests/clients")


def run(cmd: list[str], home: Path, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", **env}
    proc = subprocess.run(["timeout", str(TURN_TIMEOUT_S), *cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd[:3]} exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{proc.stdout[-3000:]}"
    return proc


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def session_log(server, session: str) -> list[dict]:
    r = server.http().get(f"/v1/sessions/{session}/messages")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_codex_two_turns_and_remote_compaction(wide_server, tmp_path):
    """Turn 1, then turn 2 with the auto-compaction limit just under what turn 1 used: Codex first
    compacts remotely (a streamed request ending in compaction_trigger; our compaction item comes
    back), then answers from the compacted history."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(f'''model = "agentkv-tiny"
model_provider = "agentkv"
model_context_window = 200000

[model_providers.agentkv]
name = "agentkv"
base_url = "{wide_server.base_url}/v1"
env_key = "AGENTKV_API_KEY"
wire_api = "responses"

[model_providers.agentkv.capabilities]
remote_compaction = "v2"
''')
    env = {"CODEX_HOME": str(home), "AGENTKV_API_KEY": API_KEY, "RUST_LOG": "codex_api::sse=trace"}
    codex = [str(BIN / "codex"), "exec", "--json", "--skip-git-repo-check"]
    first = jsonl(run([*codex, "-s", "read-only", "Say hello."], home, work, env).stdout)
    thread = next(e["thread_id"] for e in first if e["type"] == "thread.started")
    used = next(e["usage"] for e in first if e["type"] == "turn.completed")
    answer1 = [e["item"]["text"] for e in first
               if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    assert len(answer1) == 1

    limit = used["input_tokens"] + 1          # turn 1 used input + output tokens: over the limit
    resume = [*codex[:2], "resume", "--last", *codex[2:], "-c", 'sandbox_mode="read-only"',
              "-c", f"model_auto_compact_token_limit={limit}"]
    second = run([*resume, "Now say goodbye."], home, work, env)
    events = jsonl(second.stdout)
    assert any(e["type"] == "turn.completed" for e in events)
    assert [e for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    sse = [json.loads(line.split("SSE event: ", 1)[1]) for line in second.stderr.splitlines() if "SSE event: {" in line]
    compaction_items = [e["item"] for e in sse
                        if e["type"] == "response.output_item.done" and e["item"]["type"] == "compaction"]
    assert len(compaction_items) == 1, [e["type"] for e in sse]

    log = session_log(wide_server, thread)
    texts = [(m["role"], m["content"]) for m in log]
    assert ("user", "Say hello.") in texts and ("assistant", answer1[0]) in texts
    assert texts[-1] == ("user", "Now say goodbye.")
    assert [m["role"] for m in log[:2]] == ["developer", "developer"]


def test_pi_two_turns_in_responses_mode(wide_server, tmp_path):
    agent, work = tmp_path / "pi-agent", tmp_path / "work"
    agent.mkdir()
    work.mkdir()
    (agent / "models.json").write_text(json.dumps({"providers": {"agentkv": {
        "baseUrl": f"{wide_server.base_url}/v1", "api": "openai-responses", "apiKey": API_KEY,
        "models": [{"id": "agentkv-tiny", "contextWindow": 200000, "maxTokens": 64}]}}}))
    env = {"PI_CODING_AGENT_DIR": str(agent), "PI_OFFLINE": "1"}
    pi = [str(BIN / "pi"), "--provider", "agentkv", "--model", "agentkv-tiny", "--mode", "json"]
    answers, session = [], None
    for args in (["-p", "List the files."], ["-c", "-p", "Thanks."]):
        events = jsonl(run([*pi, *args], tmp_path, work, env).stdout)
        session = next(e["id"] for e in events if e["type"] == "session")
        (end,) = [e for e in events if e["type"] == "agent_end"]
        reply = end["messages"][-1]
        assert reply["role"] == "assistant" and reply["stopReason"] in ("stop", "length"), reply
        answers.append("".join(c.get("text", "") for c in reply["content"] if c["type"] == "text"))
    log = session_log(wide_server, session)
    assert [m["role"] for m in log] == ["system", "user", "assistant", "user"]
    assert [log[1]["content"], log[2]["content"], log[3]["content"]] == ["List the files.", answers[0], "Thanks."]
