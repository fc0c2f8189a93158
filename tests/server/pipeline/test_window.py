"""The served window, checked before any work: a request that cannot fit is refused at once in its
API's own "prompt is too long" words (no summary written, nothing logged), and an output limit
beyond the room the prompt leaves is lowered and said in a header, on all three APIs. Claude Code
2.1.332 against the default server (SmolLM2, 8,192 tokens) stops at once on that error (on c095b51
it waited minutes: a summary written on every one of its retries, then vLLM's 400)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from agentkv.server.errors import PromptTooLong
from agentkv.server.pipeline.engine_call import next_round
from agentkv.server.pipeline.window import fit_output

from conftest import API_KEY, REAL, REPO

CLAUDE = REPO / "tests" / "clients" / "node_modules" / ".bin" / "claude"
BIG_SYSTEM = "policy " * 9000            # ~9k tokens of SmolLM2's tokenizer: more than its window


def test_an_output_limit_beyond_the_room_is_lowered_and_a_full_prompt_refused():
    body = {"model": "m", "max_tokens": 32000}
    assert fit_output(body, 1000, 8192, "messages") == "32000 to 7192 (window 8192, prompt 1000)"
    assert body["max_tokens"] == 7192
    body = {"max_completion_tokens": 100}
    assert fit_output(body, 1000, 8192, "messages") is None and body["max_completion_tokens"] == 100
    with pytest.raises(PromptTooLong) as refused:
        fit_output({}, 8192, 8192, "input")
    assert refused.value.param == "input" and "prompt is too long: 8192 tokens > 8192 maximum" in \
        refused.value.anthropic_message


def test_a_server_tool_round_after_a_lowered_limit_runs_without_it():
    """The follow-up's prompt is longer than the one the limit was lowered for: it would no longer fit."""
    body = {"messages": [{"role": "user", "content": "find it"}], "max_tokens": 32000}
    lowered = fit_output(body, 7000, 8192, "messages")
    call = [{"id": "c1", "type": "function", "function": {"name": "agentkv_search_session", "arguments": "{}"}}]
    result = [{"id": "c1", "result": "found"}]
    follow = next_round(body, None, call, result, refit_output=lowered is not None)
    assert "max_tokens" not in follow and [m["role"] for m in follow["messages"]] == ["user", "assistant", "tool"]
    kept = next_round({**body, "max_tokens": 50}, None, call, result, refit_output=False)
    assert kept["max_tokens"] == 50 and body["max_tokens"] == 1192                  # a limit that fit stays


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_prompt_that_cannot_fit_is_refused_at_once(real_server, route):
    sid = f"big-{uuid.uuid4().hex[:8]}"
    body = {"/v1/chat/completions": {"messages": [{"role": "system", "content": BIG_SYSTEM},
                                                  {"role": "user", "content": "hi"}], "max_tokens": 10},
            "/v1/messages": {"system": BIG_SYSTEM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10},
            "/v1/responses": {"instructions": BIG_SYSTEM, "input": "hi", "max_output_tokens": 10}}[route]
    t0 = time.monotonic()
    r = real_server.http().post(route, headers={"X-Session-Id": sid}, json={"model": REAL, "stream": True, **body})
    assert time.monotonic() - t0 < 30 and r.status_code == 400, r.text   # no summary first; generous: noisy CPUs
    err = r.json()["error"]
    if route == "/v1/messages":
        assert err["type"] == "invalid_request_error" and err["message"].startswith("prompt is too long: ")
        assert "tokens > 8192 maximum" in err["message"] and "--max-model-len" in err["message"]
    else:
        assert (err["code"] == "context_length_exceeded" and "8192" in err["message"]
                and "--max-model-len" in err["message"])
        assert err["param"] == ("input" if route == "/v1/responses" else "messages")
    assert real_server.http().get(f"/v1/sessions/{sid}").status_code == 404       # nothing was logged


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_an_output_limit_over_the_window_is_lowered_not_refused(real_server, route):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"/v1/chat/completions": {"messages": ask, "max_tokens": 32000},
            "/v1/messages": {"messages": ask, "max_tokens": 32000},
            "/v1/responses": {"input": ask, "max_output_tokens": 32000}}[route]
    r = real_server.http().post(route, json={"model": REAL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    asked, _, rest = r.headers["x-max-tokens-lowered"].partition(" to ")
    assert asked == "32000" and int(rest.split()[0]) < 8192 and "window 8192" in rest
    assert "Paris" in json.dumps(r.json())
    streamed = real_server.http().post(route, json={"model": REAL, "temperature": 0, "stream": True, **body})
    assert streamed.status_code == 200 and streamed.headers["x-max-tokens-lowered"].startswith("32000 to ")


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/responses/compact"])
def test_compaction_on_demand_of_a_prompt_that_cannot_fit_is_refused_at_once(real_server, route):
    """No summary can make a system prompt fit that alone fills the window: refused before any work."""
    sid = f"big-{uuid.uuid4().hex[:8]}"
    body = {"/v1/messages": {"system": BIG_SYSTEM, "messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "hello"}],
                             "max_tokens": 10, "compaction": {"type": "summarize"}},
            "/v1/responses/compact": {"instructions": BIG_SYSTEM, "input": "hi"}}[route]
    r = real_server.http().post(route, headers={"X-Session-Id": sid, "anthropic-beta": "compact-2026-09-04"},
                                json={"model": REAL, **body})
    assert r.status_code == 400, r.text
    assert "8192" in r.json()["error"]["message"]
    assert real_server.http().get(f"/v1/sessions/{sid}").status_code == 404       # nothing was logged


@pytest.mark.skipif(not CLAUDE.exists(), reason="Claude Code is not installed (npm ci --prefix tests/clients)")
def test_claude_code_against_the_default_server_gets_the_clear_error_at_once(real_server, tmp_path):
    """Claude Code as a new user runs it, against the quick start's server: its first request (system
    prompt and 21 tools) cannot fit 8,192 tokens; it gets Anthropic's error at once and stops."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": real_server.base_url,
           "ANTHROPIC_API_KEY": API_KEY, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    t0 = time.monotonic()
    run = subprocess.run(["timeout", "300", str(CLAUDE), "-p", "Say hi.", "--model", REAL, "--max-turns", "1",
                          "--output-format", "stream-json", "--verbose"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=330)
    elapsed = time.monotonic() - t0
    result = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")][-1]
    assert result["type"] == "result" and result["is_error"] and result["api_error_status"] == 400, result
    assert result["terminal_reason"] == "prompt_too_long" and "8192" in result["result"], result
    assert result["duration_ms"] < 30_000 and elapsed < 90, (result["duration_ms"], elapsed)   # no retries
    assert real_server.http().get(f"/v1/sessions/{result['session_id']}").status_code == 404   # nothing logged
