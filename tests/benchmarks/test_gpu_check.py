"""`agentkv bench gpu-check --quick` on this CPU (Triton interpreted), run by README's own device
command with vLLM, transformers, pydantic and fastapi made unimportable: the check must run on a bare
machine with torch + triton alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentkv.benchmarks.gpu_check import CASES, GOAL
from agentkv.benchmarks.harness import machine
from agentkv.server.cli import main

REPO = Path(__file__).resolve().parents[2]
BLOCKED = ("vllm", "transformers", "pydantic", "fastapi")


def readme_device_command() -> str:
    """The bare-GPU command line, as benchmarks/README.md gives it."""
    lines = [ln.strip() for ln in (REPO / "benchmarks" / "README.md").read_text().splitlines()]
    return next(ln for ln in lines if ln.startswith("mkdir -p /tmp/agentkv-shim"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of --quick (Triton interpreted)")
def test_gpu_check_quick_passes_without_vllm(tmp_path):
    blockers = tmp_path / "blocked"
    for name in BLOCKED:
        (blockers / name).mkdir(parents=True)
        (blockers / name / "__init__.py").write_text(f"raise ImportError('gpu-check imported {name}')\n")
    shim, out = tmp_path / "shim", tmp_path / "out"
    command = (readme_device_command().replace("/tmp/agentkv-shim", str(shim))
               .replace(f"PYTHONPATH={shim}", f"PYTHONPATH={shim}:{blockers}")
               .replace("python3 -m", f"{sys.executable} -m") + f" --quick --out {out}")
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness: all passed" in proc.stdout
    result = json.loads((out / "gpu_check-quick.json").read_text())
    assert (out / "gpu_check-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["machine"] == json.loads(json.dumps(machine()))
    assert (result["device"], result["quick"], result["triton_interpreted"], result["passed"]) == \
        ("cpu", True, True, True)

    rows = result["correctness"]
    assert [r["name"] for r in rows] == [c.name for c in CASES]
    for r in rows:
        assert r["passed"] and r["tolerance_used"] <= 1.0
        assert r["slots_written"] == r["slots_expected"] > 0
        # each backend rounds once to the dtype: they differ by a few units in the last place at most
        assert r["max_abs_err_vs_torch"] <= {"float32": 1e-5, "float16": 1e-2, "bfloat16": 0.07}[r["dtype"]]
    moved = {r["name"]: r["slots_expected"] for r in rows}
    # 64 tokens, spans [1, 16) -> 3 rows and [32, 34): 47 kept, of which the 1 before the first span stays
    # in place when compacting in place; 3 replacement rows; move_tokens moves 32 scattered tokens
    assert moved["llama-3-8b"] == 47 + 3 and moved["llama-3-8b in place"] == 46 + 3
    assert moved["move_tokens, gpt-j rot 48"] == 32

    bw = result["bandwidth"]
    assert [(r["tokens"], r["layers"], r["kernel_backend"]) for r in bw] == [(1024, 2, "torch"), (4096, 2, "torch")]
    for r in bw:
        assert r["bytes"] == r["tokens"] * 8 * 128 * 2 * 2 * r["layers"] * 2      # bf16 K+V, read + write
        assert r["kernel_gb_per_s"] == pytest.approx(r["bytes"] / (r["kernel_ms"] / 1e3) / 1e9)
        assert r["ratio"] == pytest.approx(r["kernel_gb_per_s"] / r["copy_gb_per_s"])
    assert result["goal"]["target_ratio"] == GOAL and result["goal"]["met"] is None
    assert "goal does not apply" in proc.stdout


def test_cli_registers_gpu_check(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "gpu-check", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: agentkv bench gpu-check [-h] [--quick] [--out OUT]")


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without CUDA")
def test_full_size_without_cuda_is_a_cli_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "gpu-check"])
    assert exit_.value.code == 2
    assert "gpu-check needs a CUDA device; without one only --quick runs" in capsys.readouterr().err
