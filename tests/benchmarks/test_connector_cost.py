"""The connector-cost benchmark: requests that never clear, A/B between a server with the KV
connector (the default: retention) and one without (``--no-kv-retention``, same model and
settings), at its --quick size; and its summary."""

from __future__ import annotations

import json

import pytest

from agentkv.benchmarks.connector_cost import paired, summarize
from agentkv.server.cli import main


@pytest.fixture(scope="module")
def servers(server, no_connector_server):
    return server, no_connector_server


def test_quick_run_pairs_every_request_and_reports_the_goal(servers, tmp_path):
    on, off = servers
    main(["bench", "connector-cost", "--quick", "--url-on", on.base_url, "--url-off", off.base_url,
          "--api-key", on.api_key, "--tool-lines", "10", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "connector-cost-quick.json").read_text())
    assert (tmp_path / "connector-cost-quick.png").stat().st_size > 1000
    assert r["machine"]["cpu"] and r["model"] == "agentkv-tiny" and r["goal"] == 0.03
    assert len(r["rows"]) == 2 * r["sessions"] * r["turns"] == 12
    assert all(row["completion_tokens"] == 8 and row["ttft_s"] > 0 for row in r["rows"])
    for key in ("ttft_s", "decode_tps"):
        s = r["summary"][key]
        assert s["pairs"] == 6 and s["median_paired_ratio"] > 0
        assert s["goal_met"] == (s["cost"] <= 0.03)
    # the "on" server (the default) held each turn's blocks for the next: its engine counts them
    held = [float(line.rsplit(" ", 1)[1]) for line in on.http().get("/metrics").text.splitlines()
            if line.startswith("vllm:agentkv_kv_held_blocks{")]
    assert held and held[0] > 0


def test_summary_pairs_on_with_off():
    rows = [{"connector": c, "session": 0, "turn": t, "ttft_s": v, "decode_tps": d}
            for t, (c, v, d) in enumerate([("on", 1.1, 90.0), ("on", 2.0, 100.0)])]
    rows += [{"connector": "off", "session": 0, "turn": t, "ttft_s": 1.0, "decode_tps": 100.0} for t in range(2)]
    assert paired(rows, "ttft_s") == [1.1, 2.0]
    s = summarize(rows)
    assert s["ttft_s"]["median_paired_ratio"] == pytest.approx(1.55) and not s["ttft_s"]["goal_met"]
    assert s["decode_tps"]["cost"] == pytest.approx(0.05) and not s["decode_tps"]["goal_met"]
