"""Load: concurrent agent sessions doing tool loops with clearing; no errors, every log complete, in
each KV mode (recompute on a server without the KV connector; shift and blend on one with it)."""

from __future__ import annotations

import json

import pytest

from agentkv.kernels.connector.params import FALLBACKS as REASONS
from agentkv.server.cli import main

from conftest import start_server


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("agentkv-kv-load"), "--model", "agentkv-tiny",
                       "--max-model-len", "1024", "--kv-reuse", "shift")
    yield srv
    srv.stop()


@pytest.mark.parametrize("mode", ["recompute", "shift", "blend"])
def test_concurrent_tool_loops_with_clearing_lose_nothing(request, tmp_path, mode):
    srv = request.getfixturevalue("small_server" if mode == "recompute" else "kv_server")
    main(["bench", "load", "--quick", "--kv-reuse", mode, "--url", srv.base_url, "--api-key", srv.api_key,
          "--out", str(tmp_path)])
    name = "load-quick" if mode == "recompute" else f"load-{mode}-quick"
    r = json.loads((tmp_path / f"{name}.json").read_text())
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert r["errors"] == 0, r["error_messages"]
    assert r["requests"] == r["sessions"] * r["turns"] == 20
    assert r["logs_complete"] == r["sessions"]           # each server-side log equals what was sent
    assert r["requests_with_clearing"] > 0                # the 1k window made clearing fire
    assert r["requests_per_s"] > 0 and 0 < r["latency_p50_s"] <= r["latency_p99_s"]
    assert r["machine"]["cpu"] and r["kv_reuse"] == mode
    if mode == "recompute":
        assert r["kv_edits"] == 0
    else:                                                 # every edit reached the connector and was answered
        assert r["kv_edits"] > 0 and set(r["kv_fallbacks"]) <= set(REASONS)
        assert r["kv_reused_tokens"] > 0 or sum(r["kv_fallbacks"].values()) == r["kv_edits"]
