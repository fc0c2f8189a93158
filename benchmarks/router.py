"""The router of ``deploy/router/haproxy.cfg`` in front of replicas on this machine: the file as
deployed, its DNS ``server-template`` line replaced by one ``server`` line per replica URL. Used by
``agentkv bench replicas`` and the replica tests; HAProxy is Debian's ``haproxy`` package."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from agentkv.server.engine.process import dies_with_parent, free_port

from .harness import wait_ready

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "router" / "haproxy.cfg"
_TEMPLATE = re.compile(r"^(\s*)server-template .*$", re.M)


def render(replicas: list[str], config: str | None = None) -> str:
    """The deployed configuration with ``replicas`` (``http://host:port``) as its servers, named
    ``replica1``... in order."""
    text = config if config is not None else CONFIG.read_text()
    m = _TEMPLATE.search(text)
    if m is None:
        raise ValueError(f"{CONFIG} has no server-template line to replace")
    lines = [f"{m.group(1)}server replica{i} {urlsplit(u).hostname}:{urlsplit(u).port} check"
             for i, u in enumerate(replicas, 1)]
    return text[:m.start()] + "\n".join(lines) + text[m.end():]


class Router:
    """A running router: ``url`` (the API), ``stats_url`` (HAProxy's Prometheus metrics at
    ``/metrics``), ``log_path``."""

    def __init__(self, proc: subprocess.Popen, url: str, stats_url: str, log_path: Path):
        self.proc, self.url, self.stats_url, self.log_path = proc, url, stats_url, log_path

    def _per_server(self, metric: str, labels: str = "") -> list[tuple[str, int]]:
        """(server, value) of each sample of one of HAProxy's per-replica metrics."""
        text = httpx.get(f"{self.stats_url}/metrics", timeout=10).text
        pattern = rf'^{metric}\{{proxy="replicas",server="([^"]+)"{labels}\}} (\d+)'
        return [(m.group(1), int(m.group(2))) for m in re.finditer(pattern, text, re.M)]

    def server_responses(self) -> dict[str, int]:
        """HTTP responses each replica gave through the router (HAProxy's own count), by server name."""
        out: dict[str, int] = {}
        for server, n in self._per_server("haproxy_server_http_responses_total", ',code="[^"]+"'):
            out[server] = out.get(server, 0) + n
        return out

    def up(self) -> dict[str, bool]:
        """Whether the router's health check takes each replica as up, by server name."""
        return {server: n == 1 for server, n in self._per_server("haproxy_server_status", ',state="UP"')}


def find_haproxy() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.path.exists(p)), None)


@contextlib.contextmanager
def run_router(replicas: list[str], workdir: Path | None = None, config: str | None = None,
               timeout_s: float = 60) -> Iterator[Router]:
    """HAProxy with the deployed configuration in front of ``replicas`` on free loopback ports,
    stopped on the way out (also on an exception or an interrupt)."""
    exe = find_haproxy()
    if exe is None:
        raise RuntimeError("HAProxy is not installed (Debian: apt-get install haproxy); .ci/run installs it")
    workdir = Path(workdir or tempfile.mkdtemp(prefix="agentkv-router-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cfg, log_path = workdir / "haproxy.cfg", workdir / "router.log"
    cfg.write_text(render(replicas, config))
    port, stats = free_port(), free_port()
    env = dict(os.environ, AGENTKV_ROUTER_BIND=f"127.0.0.1:{port}", AGENTKV_ROUTER_STATS_BIND=f"127.0.0.1:{stats}")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([exe, "-db", "-f", str(cfg)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=dies_with_parent())
    router = Router(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{stats}", log_path)
    try:   # ready once it sees a replica up
        wait_ready(proc, f"{router.url}/router/health", timeout_s, "the router", log_path)
        yield router
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
