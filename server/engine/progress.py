"""Whether the engine makes progress: the evidence of the stall watchdog (``Supervisor``).

A hung engine (a GPU hang, a deadlocked collective, a host swapped out, a process stopped) is still
a live process, and vLLM's own ``/health`` says only whether its engine process errored. So the
front watches what the engine does:

- **Work in flight must progress.** While the front has requests at the engine (``Inflight``), the
  engine's token counters (``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total``, read from
  its ``/metrics`` under a deadline) must move, or, on CPU, the processes that compute (the leaves
  of the engine's process tree: vLLM's workers) must use CPU time. A long CPU prefill moves no
  counter until it ends but keeps its workers busy, so it is progress however long it takes; a
  stopped or deadlocked worker uses none. On a GPU a worker may spin on a hung device, so only the
  counters count there (one engine step, a prefill chunk included, takes seconds, not minutes).
- **No process of the engine may stay stopped** (``T`` state: SIGSTOP, a debugger), idle or not.

Either for ``stall_s`` seconds means stuck (``ProgressWatch.observe`` says why). The default,
120 s on both devices (``DEFAULT_STALL_S``), is chosen from what is legitimate: on CPU any running
step is progress, so the bound only has to outlast a host whose CPU was taken away (steal at 100%
was seen here for minutes); on a GPU it outlasts the longest single step of a long-context
prefill by an order of magnitude.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import psutil

DEFAULT_STALL_S = {"cpu": 120.0, "cuda": 120.0}
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


class Inflight:
    """Requests the front has at the engine now (the event loop's and worker threads' alike)."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def __enter__(self) -> Inflight:
        with self._lock:
            self.n += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.n -= 1


def tokens_of(metrics_text: str) -> float:
    """The engine's prompt and generated tokens so far, summed over its label sets."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(COUNTERS):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                pass
    return total


@dataclass
class Processes:
    """One look at the engine's process tree: any process stopped, and the compute processes' CPU."""

    stopped: list[str]
    compute_cpu_s: float


def look(pid: int) -> Processes | None:
    """The tree under the engine's own process ``pid`` (None: it is gone)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    stopped, cpu = [], 0.0
    for p in tree:
        try:
            if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                stopped.append(f"{p.name()} ({p.pid})")
            if not p.children():
                t = p.cpu_times()
                cpu += t.user + t.system
        except psutil.Error:   # gone between the listing and the look
            continue
    return Processes(stopped, cpu)


class ProgressWatch:
    """Fed one observation a tick; says why the engine is stuck once it has been for ``stall_s``."""

    def __init__(self, stall_s: float, device: str):
        self.stall_s, self.cpu_counts = stall_s, device == "cpu"
        self._since: float | None = None          # when the current stretch without progress began
        self._stopped_since: float | None = None
        self._cpu: float | None = None
        self._tokens: float | None = None

    def observe(self, inflight: int, procs: Processes | None, tokens: float | None,
                now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        if procs is None:
            return None                            # the process is gone: the watchdog sees the exit
        if procs.stopped:
            if self._stopped_since is None:
                self._stopped_since = now
            if now - self._stopped_since >= self.stall_s:
                return (f"the vLLM engine was stuck: {', '.join(procs.stopped)} stopped for "
                        f"{now - self._stopped_since:.0f} s")
        else:
            self._stopped_since = None
        cpu_moved = self._cpu is not None and procs.compute_cpu_s - self._cpu > 0.005
        tokens_moved = tokens is not None and self._tokens is not None and tokens > self._tokens
        self._cpu = procs.compute_cpu_s
        self._tokens = tokens if tokens is not None else self._tokens
        if inflight <= 0 or tokens_moved or (self.cpu_counts and cpu_moved):
            self._since = None
            return None
        if self._since is None:
            self._since = now
        if now - self._since >= self.stall_s:
            return (f"the vLLM engine was stuck: no progress for {now - self._since:.0f} s with {inflight} "
                    f"request(s) in flight (--engine-stall-s {self.stall_s:g})")
        return None

    def needs_tokens(self, procs: Processes | None, inflight: int) -> bool:
        """Whether this tick should read the engine's counters (a ``/metrics`` call): only with work
        in flight, and on CPU only where the compute processes' CPU time did not move."""
        if inflight <= 0 or procs is None:
            return False
        return not self.cpu_counts or self._cpu is None or procs.compute_cpu_s - self._cpu <= 0.005
