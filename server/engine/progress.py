"""Whether the engine makes progress: the evidence of the stall watchdog (``Supervisor``).

A hung engine (a GPU hang, a deadlocked collective or hook, a host swapped out, a process stopped)
is still a live process, and vLLM's own ``/health`` says only whether its engine process errored.
So the front watches what the engine itself reports, never what clients do with its answers:

- **Work** is what the engine has to do: the requests vLLM's scheduler has running or waiting
  (``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` as of its last step), and the
  requests the front sent that have no byte of answer yet (``Awaiting``: ones the engine has not
  reached a step on, which an engine hung before that step never reports). A request whose answer
  the engine has finished is not work, whatever its client does (a client that stops reading a
  stream holds only the front's relay, never the engine).
- **Progress** is anything that moves with an engine step (``PROGRESS``): tokens prefilled and
  generated, the KV pool's use (every prefill chunk takes blocks), admissions and preemptions, and
  the tokens agentkv's KV connector sees the scheduler give each step (prefill chunks included:
  vLLM's prompt counter moves only when a whole prefill ends). A long prefill is progress step by
  step, on a GPU or a CPU. CPU time is not: an idle vLLM worker polls, which hid a hung one.
- **No answer** from the engine's ``/metrics`` within the deadline is no progress.
- **No process of the engine may stay stopped** (``T`` state: SIGSTOP, a debugger), idle or not.

Work without progress, or a stopped process, for ``stall_s`` seconds is stuck
(``ProgressWatch.observe`` says why). A stretch the front itself did not watch (its own loop late
by ``lag_s``: a host whose CPU was taken away stops the front too) starts the count again. The
default bound, 120 s on both devices (``DEFAULT_STALL_S``), outlasts the longest legitimate step
(one prefill chunk) by an order of magnitude.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import psutil

DEFAULT_STALL_S = {"cpu": 120.0, "cuda": 120.0}
WORK = ("vllm:num_requests_running", "vllm:num_requests_waiting")
PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:agentkv_kv_scheduled_tokens_total")


class Awaiting:
    """Requests the front sent to one engine (one launch) that have no byte of answer yet."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.n += 1

    def leave(self) -> None:
        with self._lock:
            self.n -= 1


@dataclass(frozen=True)
class EngineReading:
    """One read of the engine's ``/metrics``: its scheduler's requests running or waiting, and the
    values that move with its steps."""

    work: float
    progress: tuple[float, ...]


def reading_of(metrics_text: str) -> EngineReading:
    """``WORK`` and ``PROGRESS`` from vLLM's Prometheus text, each summed over its label sets."""
    values = dict.fromkeys(WORK + PROGRESS, 0.0)
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if name in values:
            try:
                values[name] += float(value)
            except ValueError:
                pass
    return EngineReading(sum(values[n] for n in WORK), tuple(values[n] for n in PROGRESS))


@dataclass
class Processes:
    """One look at the engine's process tree: the processes stopped."""

    stopped: list[str]


def look(pid: int) -> Processes | None:
    """The tree under the engine's own process ``pid`` (None: it is gone)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    stopped = []
    for p in tree:
        try:
            if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                stopped.append(f"{p.name()} ({p.pid})")
        except psutil.Error:   # gone between the listing and the look
            continue
    return Processes(stopped)


class ProgressWatch:
    """Fed one observation a tick; says why the engine is stuck once it has been for ``stall_s``."""

    def __init__(self, stall_s: float, lag_s: float | None = None):
        self.stall_s = stall_s
        self.lag_s = lag_s if lag_s is not None else max(10.0, stall_s / 4)
        self._tick: float | None = None
        self._since: float | None = None          # when the current stretch of work without progress began
        self._ok_at: float | None = None          # the last read that saw progress, or no work
        self._stopped_since: float | None = None
        self._silent_since: float | None = None   # when /metrics stopped answering
        self._progress: tuple[float, ...] | None = None
        self._work = 0.0                           # the engine's own count, as of the last reading

    def wants_reading(self, awaiting: int) -> bool:
        """Whether the engine's counters are worth a ``/metrics`` call: only while there is work
        (idle, the engine only gets work through the front, which then awaits its answer)."""
        return awaiting > 0 or self._work > 0

    def observe(self, awaiting: int, procs: Processes | None, reading: EngineReading | None = None,
                read: bool = False, now: float | None = None) -> str | None:
        """One tick: ``awaiting`` requests without an answer yet, the process tree, and (``read``)
        the engine's reading, None where it did not answer."""
        now = time.monotonic() if now is None else now
        if self._tick is not None and now - self._tick > self.lag_s:   # the front did not watch meanwhile
            self._since = self._stopped_since = self._silent_since = None
            self._ok_at = now
        self._tick = now
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
        if awaiting <= 0 and self._work <= 0:   # idle (as of the last reading): nothing to judge up to now
            self._since, self._ok_at = None, now
        if not read:
            return None
        moved = False
        if reading is None:
            self._silent_since = self._silent_since if self._silent_since is not None else now
        else:
            self._silent_since = None
            moved = self._progress is None or reading.progress != self._progress
            self._progress, self._work = reading.progress, reading.work
        work = max(float(awaiting), self._work)
        if work <= 0 or moved:
            self._since, self._ok_at = None, now
            return None
        if self._since is None:   # nothing moved since the last read that saw it move (or saw no work)
            self._since = self._ok_at if self._ok_at is not None else now
        if now - self._since < self.stall_s:
            return None
        if self._silent_since is not None and self._silent_since <= self._since:
            return (f"the vLLM engine was stuck: its API server did not answer for {now - self._since:.0f} s "
                    f"with {awaiting} request(s) awaiting an answer (--engine-stall-s {self.stall_s:g})")
        return (f"the vLLM engine was stuck: no progress for {now - self._since:.0f} s with {work:.0f} request(s) "
                f"running or waiting (--engine-stall-s {self.stall_s:g})")
