"""Load: concurrent agent sessions doing tool loops with clearing; no errors, every log complete."""

from __future__ import annotations

import json

from agentkv.server.cli import main


def test_concurrent_tool_loops_with_clearing_lose_nothing(small_server, tmp_path):
    main(["bench", "load", "--quick", "--url", small_server.base_url, "--api-key", small_server.api_key,
          "--out", str(tmp_path)])
    r = json.loads((tmp_path / "load-quick.json").read_text())
    assert (tmp_path / "load-quick.png").stat().st_size > 1000
    assert r["errors"] == 0, r["error_messages"]
    assert r["requests"] == r["sessions"] * r["turns"] == 20
    assert r["logs_complete"] == r["sessions"]           # each server-side log equals what was sent
    assert r["requests_with_clearing"] > 0                # the 1k window made clearing fire
    assert r["requests_per_s"] > 0 and 0 < r["latency_p50_s"] <= r["latency_p99_s"]
    assert r["machine"]["cpu"]
