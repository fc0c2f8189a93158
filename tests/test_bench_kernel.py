"""Smoke test of the kernel benchmark at its --quick size: it measures, writes JSON + PNG, names the machine."""

from __future__ import annotations

import json

from agentkv.server.cli import main


def test_kernel_bench_quick_writes_results(tmp_path, capsys):
    main(["bench", "kernel", "--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kernel-quick.json").read_text())
    assert (tmp_path / "kernel-quick.png").stat().st_size > 1000
    assert result["machine"]["cpu"] and result["machine"]["torch"]
    fast = [r for r in result["rows"] if r["backend"] in ("torch", "triton")]
    assert [r["retained_tokens"] for r in fast] == [1024, 4096]
    assert all(r["seconds"] > 0 and r["bytes_moved"] > 0 for r in result["rows"])
    assert result["speedup_vs_loop"]["1024"] > 0
    assert "evict_spans" in capsys.readouterr().out
