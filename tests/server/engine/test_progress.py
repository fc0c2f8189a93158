"""The stall watchdog's rule (server/engine/progress.py), observation by observation: work (what the
engine's scheduler has running or waiting, or requests with no byte of answer yet) must move what
the engine's steps move; no process may stay stopped; either for ``stall_s`` is stuck. CPU time is
no evidence, and a stretch the front did not watch starts the count again.
(tests/server/engine/test_faults.py hangs and stops a real engine.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from agentkv.server.engine.progress import PROGRESS, Awaiting, EngineReading, Processes, ProgressWatch, look, reading_of


def reading(work: float, *progress: float) -> EngineReading:
    return EngineReading(work, tuple(progress) + (0.0,) * (len(PROGRESS) - len(progress)))


def run(watch: ProgressWatch, steps) -> list[str | None]:
    """``steps``: (seconds, awaiting, stopped, reading or None: no answer) observations, each a read."""
    return [watch.observe(n, Processes(["w (1)"] if stopped else []), r, read=True, now=t)
            for t, n, stopped, r in steps]


def test_work_whose_counters_move_is_never_stuck():
    steps = [(t, 0, False, reading(1, float(t))) for t in range(0, 60, 2)]
    assert not any(run(ProgressWatch(5), steps))


def test_a_long_prefill_moves_step_by_step_on_any_device():
    """vLLM's prompt counter stays still until a whole prefill ends; the tokens the scheduler gives
    each chunk (agentkv's connector) and the KV blocks each chunk takes move every step."""
    steps = [(t, 1, False, reading(1, 100.0, 0.0, 0.01 * t, 0.0, 1.0, 512.0 * t)) for t in range(0, 30)]
    assert not any(run(ProgressWatch(5), steps))


def test_work_that_stops_moving_is_stuck_after_the_bound_and_not_before():
    moving = [(t, 0, False, reading(2, float(t))) for t in range(0, 10)]
    still = [(t, 0, False, reading(2, 9.0)) for t in range(10, 30)]
    out = run(ProgressWatch(8), moving + still)
    first = next(i for i, x in enumerate(out) if x)
    assert moving[-1][0] + 8 <= (moving + still)[first][0] <= moving[-1][0] + 9
    assert "no progress for 8 s with 2 request(s) running or waiting" in out[first]


def test_an_answer_its_client_does_not_read_is_not_work():
    """The engine finished (nothing running or waiting): a client that never reads its stream
    leaves nothing awaiting an answer, so nothing is stuck however long it takes (issue 51, W1)."""
    steps = [(t, 0, False, reading(0, 500.0)) for t in range(0, 600, 5)]
    assert not any(run(ProgressWatch(8), steps))


def test_a_request_the_engine_never_steps_on_is_stuck():
    """Its scheduler hung before its first step on a new request: the engine's own gauges still
    say idle, but the front awaits an answer (issue 51, W3)."""
    steps = [(t, 1, False, reading(0, 7.0)) for t in range(0, 20)]
    out = run(ProgressWatch(8), steps)
    assert out[:8] == [None] * 8 and "no progress for 8 s with 1 request(s)" in out[8]


def test_an_api_server_that_does_not_answer_is_stuck_when_something_awaits_it():
    out = run(ProgressWatch(6), [(t, 1, False, None) for t in range(0, 10)])
    assert out[:6] == [None] * 6 and "its API server did not answer for 6 s" in out[6]
    assert not any(run(ProgressWatch(6), [(t, 0, False, None) for t in range(0, 20)]))   # idle: nothing to judge


def test_idle_is_not_stuck_but_a_stopped_process_is():
    idle = [(t, 0, False, reading(0, 3.0)) for t in range(0, 30)]
    assert not any(run(ProgressWatch(5), idle))
    stopped = run(ProgressWatch(5), [(t, 0, True, reading(0)) for t in range(0, 10)])
    assert stopped[:5] == [None] * 5 and "w (1) stopped for 5 s" in stopped[5]
    resumed = run(ProgressWatch(5), [(0, 0, True, None), (3, 0, False, None), (6, 0, True, None), (9, 0, True, None)])
    assert not any(resumed)   # stopped 3 s, running, stopped 3 s: never 5 s on end


def test_a_stretch_the_front_did_not_watch_starts_the_count_again():
    """The host's CPU taken away stops the front's loop too: a tick 40 s late says nothing about
    those 40 s, so the engine is judged from then on."""
    watch = ProgressWatch(30, lag_s=10)
    assert watch.observe(1, Processes([]), reading(1, 5.0), read=True, now=0) is None
    assert watch.observe(1, Processes([]), reading(1, 5.0), read=True, now=1) is None
    assert watch.observe(1, Processes([]), reading(1, 5.0), read=True, now=41) is None   # late: counts from 41
    for t in range(46, 71, 5):
        assert watch.observe(1, Processes([]), reading(1, 5.0), read=True, now=t) is None
    assert "no progress for 30 s" in watch.observe(1, Processes([]), reading(1, 5.0), read=True, now=71)


def test_a_request_after_a_long_idle_stretch_is_judged_from_its_arrival():
    """Idle for an hour (no reads: nothing to read), then a request whose first step has not come
    yet at the first read: not stuck (it was, at once, before a review's fix), and stuck only a
    whole bound after its arrival if nothing moves."""
    watch = ProgressWatch(120)
    assert watch.observe(1, Processes([]), reading(1, 5.0), read=True, now=0) is None
    assert watch.observe(0, Processes([]), reading(0, 9.0), read=True, now=2) is None     # done: idle
    for t in range(3, 3600):
        assert watch.observe(0, Processes([]), None, read=False, now=t) is None
    for t in range(3600, 3719, 5):                 # the request came at 3599.5: nothing moves
        assert watch.observe(1, Processes([]), reading(0, 9.0), read=True, now=t + 0.5) is None
    assert "no progress for 121 s" in watch.observe(1, Processes([]), reading(0, 9.0), read=True, now=3720)


def test_ticks_without_a_read_judge_only_the_processes():
    watch = ProgressWatch(5)
    assert watch.observe(1, Processes([]), reading(1, 1.0), read=True, now=0) is None
    for t in range(1, 20):
        assert watch.observe(1, Processes([]), None, read=False, now=t) is None
    assert "no progress" in watch.observe(1, Processes([]), reading(1, 1.0), read=True, now=20)
    assert watch.wants_reading(0)                 # the engine said it had work: read until it says not
    watch.observe(0, Processes([]), reading(0, 2.0), read=True, now=21)
    assert not watch.wants_reading(0) and watch.wants_reading(1)


def test_work_and_progress_are_read_from_the_engines_metrics():
    text = ('# HELP vllm:prompt_tokens_total x\nvllm:prompt_tokens_total{engine="0",model_name="m"} 120.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 7.0\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:agentkv_kv_scheduled_tokens_total{engine="0",model_name="m"} 4096.0\n')
    r = reading_of(text)
    assert r.work == 3.0
    values = dict(zip(PROGRESS, r.progress))
    assert values["vllm:prompt_tokens_total"] == 120.0 and values["vllm:generation_tokens_total"] == 7.0
    assert values["vllm:kv_cache_usage_perc"] == 0.25
    assert values["vllm:agentkv_kv_scheduled_tokens_total"] == 4096.0


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


def test_awaiting_counts_across_threads():
    import threading

    work = Awaiting()
    work.enter()
    threads = [threading.Thread(target=work.enter) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert work.n == 9
    work.leave()
    assert work.n == 8
