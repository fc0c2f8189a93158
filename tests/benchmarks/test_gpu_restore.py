"""The gpu-restore benchmark at its --quick size on this machine's device: a held prompt spilled
to the host tier and read back by the connector's worker code is the same K/V, bit for bit, and the
result files are written (the GPU run is the same code at Llama-3-8B sizes)."""

from __future__ import annotations

import json

from agentkv.benchmarks.gpu_restore import main


def test_quick_run_reads_back_exactly_what_was_spilled(tmp_path):
    result = main(["--quick", "--out", str(tmp_path)])
    assert [r["tokens"] for r in result["rows"]] == [256, 1024]
    assert all(r["exact"] and r["restore_ms"] > 0 for r in result["rows"])
    saved = json.loads((tmp_path / "gpu-restore-quick.json").read_text())
    assert saved["machine"]["cpu"] and saved["shape"].startswith("Llama-3-8B K/V (2 layers")
    assert (tmp_path / "gpu-restore-quick.png").stat().st_size > 1000
