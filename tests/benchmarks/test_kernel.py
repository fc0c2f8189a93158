"""The kernel benchmark at its --quick size: its rows are consistent with what it moved, and it writes
JSON + PNG and a table naming this machine."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict

import pytest

from agentkv.benchmarks.harness import machine, machine_line
from agentkv.benchmarks.kernel_bench import Shape
from agentkv.server.cli import main


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after checking the signature)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_kernel_bench_quick_writes_results(tmp_path, capsys):
    main(["bench", "kernel", "--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kernel-quick.json").read_text())
    width, height = png_size(tmp_path / "kernel-quick.png")
    assert 900 <= width <= 1320 and 350 <= height <= 600        # 11 x 4 in at 120 dpi, bbox "tight"
    assert result["machine"] == json.loads(json.dumps(machine()))
    assert result["shape"] == asdict(Shape())
    assert [(r["retained_tokens"], r["backend"]) for r in result["rows"]] == [
        (1024, "torch"), (1024, "loop"), (4096, "torch")]
    s = Shape()
    row_bytes = s.kv_heads * s.head_dim * 2 * 2                 # bf16 K and V of one token
    for r in result["rows"]:
        assert r["layers"] == 1
        # the dropped span is in front of every retained token, so all of them move: read + write
        assert r["bytes_moved"] == r["retained_tokens"] * row_bytes * 2
        assert r["gb_per_s"] == pytest.approx(r["bytes_moved"] / r["seconds"] / 1e9)
        assert r["tokens_per_s"] == pytest.approx(r["retained_tokens"] / r["seconds"])
    torch_1k, loop_1k = result["rows"][0], result["rows"][1]
    assert result["speedup_vs_loop"] == {"1024": pytest.approx(loop_1k["seconds"] / torch_1k["seconds"])}
    out = capsys.readouterr().out
    assert "evict_spans" in out and machine_line(result["machine"]).split(" | ")[0] in out
