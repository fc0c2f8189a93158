"""Each engine benchmark at its --quick size against the real server: JSON + PNG, machine named."""

from __future__ import annotations

import json

import pytest

from agentkv.server.cli import main


@pytest.mark.parametrize("name", ["kv-memory", "decode-throughput", "delayed-recall", "probe"])
def test_quick_benchmark_writes_results(server, tmp_path, name):
    main(["bench", name, "--quick", "--url", server.base_url, "--api-key", server.api_key, "--out", str(tmp_path)])
    result = json.loads((tmp_path / f"{name}-quick.json").read_text())
    assert (tmp_path / f"{name}-quick.png").stat().st_size > 1000
    assert result["machine"]["cpu"] and result["model"] == "agentkv-tiny"
    if name == "kv-memory":
        assert result["measured"]["bytes_per_token"] == result["served_model"]["formula_bytes_per_token"]
        none = [r for r in result["session"] if r["policy"] == "none"]
        cleared = [r for r in result["session"] if r["policy"] == "clearing"]
        assert cleared[-1]["prompt_tokens"] < none[-1]["prompt_tokens"]
    elif name == "decode-throughput":
        assert [(r["context"], r["batch"]) for r in result["rows"]] == [(256, 1), (256, 2), (1024, 1), (1024, 2)]
        for r in result["rows"]:  # every request decoded all its tokens (ignore_eos), after its first one
            assert r["tokens_per_request"] == 8
            assert r["aggregate_tok_s"] == pytest.approx(r["batch"] * 8 / r["wall_s"])
            assert 0 < r["ttft_s_mean"] < r["wall_s"]
    elif name == "delayed-recall":
        assert sum(r["answers"] for r in result["rows"]) == 4 * 12
        assert all(r["correct"] + r["invented"] + r["not_sure"] + r["overflow"] == r["answers"]
                   for r in result["rows"])
        assert result["window"] == 2048                       # --quick: triggers of a 2k window
        assert all(r["asked_by_phase"] == {"0": 4, "1": 4, "2": 4} for r in result["rows"])   # JSON keys
    else:
        assert [r["instructions"] for r in result["rows"]] == ["full documents"] * 2 + ["default"] * 2 + ["guided"] * 2
        assert all(r["facts"] == 2 for r in result["rows"])       # two documents, one fact of each kind
        assert all(f["kept_in_summary"] is None for f in result["facts"]["full documents"])
