"""The stall watchdog's rule (server/engine/progress.py), observation by observation: work in flight
must move the engine's token counters or, on CPU, its workers' CPU time; no process may stay
stopped; either for ``stall_s`` is stuck. (tests/server/engine/test_faults.py stops a real engine.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from agentkv.server.engine.progress import Inflight, Processes, ProgressWatch, look, tokens_of


def run(watch: ProgressWatch, steps) -> list[str | None]:
    """``steps``: (seconds, inflight, stopped, cpu, tokens) observations."""
    return [watch.observe(n, Processes(["w (1)"] if stopped else [], cpu), tokens, now=t)
            for t, n, stopped, cpu, tokens in steps]


def test_work_whose_counters_move_is_never_stuck():
    steps = [(t, 1, False, 0.0, float(t)) for t in range(0, 60, 2)]
    assert not any(run(ProgressWatch(5, "cuda"), steps))


def test_a_long_prefill_is_progress_on_cpu_not_on_a_gpu():
    """Counters still while the workers compute: CPU time is progress on CPU only (a GPU worker
    may spin on a hung device)."""
    steps = [(t, 1, False, float(t), 100.0) for t in range(0, 30)]
    assert not any(run(ProgressWatch(5, "cpu"), steps))
    out = run(ProgressWatch(5, "cuda"), steps)
    assert out[:5] == [None] * 5 and "no progress for 5 s with 1 request" in out[5]


def test_work_that_stops_moving_is_stuck_after_the_bound_and_not_before():
    moving = [(t, 2, False, float(t), float(t)) for t in range(0, 10)]
    still = [(t, 2, False, 9.0, 9.0) for t in range(10, 30)]
    out = run(ProgressWatch(8, "cpu"), moving + still)
    first = next(i for i, x in enumerate(out) if x)
    assert moving[-1][0] + 8 <= (moving + still)[first][0] <= moving[-1][0] + 9


def test_idle_is_not_stuck_but_a_stopped_process_is():
    idle = [(t, 0, False, 0.0, 0.0) for t in range(0, 30)]
    assert not any(run(ProgressWatch(5, "cpu"), idle))
    stopped = run(ProgressWatch(5, "cpu"), [(t, 0, True, 0.0, 0.0) for t in range(0, 10)])
    assert stopped[:5] == [None] * 5 and "w (1) stopped for 5 s" in stopped[5]
    resumed = run(ProgressWatch(5, "cpu"), [(0, 0, True, 0, 0), (3, 0, False, 0, 0), (6, 0, True, 0, 0),
                                            (9, 0, True, 0, 0)])
    assert not any(resumed)   # stopped 3 s, running, stopped 3 s: never 5 s on end


def test_counters_are_read_from_the_engines_metrics():
    text = ('# HELP vllm:prompt_tokens_total x\nvllm:prompt_tokens_total{engine="0",model_name="m"} 120.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 7.0\nvllm:num_requests_running 1.0\n')
    assert tokens_of(text) == 127.0


def test_look_sees_a_stopped_process_in_a_real_tree():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        assert look(child.pid).stopped == []
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not look(child.pid).stopped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert look(child.pid).stopped[0].endswith(f"({child.pid})")
    finally:
        child.kill()
        child.wait()
    assert look(child.pid) is None


def test_inflight_counts_across_threads():
    import threading

    work = Inflight()
    with work:
        threads = [threading.Thread(target=lambda: work.__enter__()) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert work.n == 9
