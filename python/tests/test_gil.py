"""forward and decode release the GIL: two Python threads calling one shared layer finish faster than the
same calls one after the other (a timing check: ctest runs python.pytest alone, RUN_SERIAL), and Python code
on another thread keeps running during a call (a check that does not depend on the machine's load).
c2f._c2f._debug.set_hold_gil(True) keeps the GIL, and both checks then fail (the last tests)."""

import os
import threading
import time

import numpy as np
import pytest

import c2f

debug = c2f._c2f._debug
CALLS = 4  # per thread
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs to run two threads at once")


@pytest.fixture(autouse=True)
def gil_released():
    debug.set_hold_gil(False)
    yield
    debug.set_hold_gil(False)


def timings(call):
    """(sequential, parallel) seconds, best of 3: 2·CALLS calls on this thread, then CALLS on each of two
    threads. The layers run on one thread each (num_threads=1): any gain is the two Python threads'."""
    call()  # warm-up (scratch memory, pages)
    best_seq = best_par = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(2 * CALLS):
            call()
        best_seq = min(best_seq, time.perf_counter() - start)
        threads = [threading.Thread(target=lambda: [call() for _ in range(CALLS)]) for _ in range(2)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best_par = min(best_par, time.perf_counter() - start)
    return best_seq, best_par


def forward_call(length=768):
    """A forward of about 30-60 ms at L = 768 (0.1-0.3 s at 2048), on one thread."""
    layer = c2f.MultiHeadAttention(256, 4, num_threads=1)
    x = np.random.default_rng(0).standard_normal((1, length, 256)).astype(np.float32)
    return lambda: layer(x)


def decode_call():
    layer = c2f.MultiHeadAttention(256, 4, causal=True, num_threads=1)
    x = np.random.default_rng(0).standard_normal((1, 768, 256)).astype(np.float32)

    def call():  # a state per call (a state serves one call at a time), the layer shared
        state = layer.new_decode_state(1)
        layer.decode(x, state)
    return call


@pytest.mark.parametrize("make", [forward_call, decode_call], ids=["forward", "decode"])
def test_two_threads_run_in_parallel(make):
    seq, par = timings(make())
    assert par < 0.8 * seq, f"two threads took {par:.3f} s, one after the other {seq:.3f} s"


def longest_pause(call):
    """The longest stretch (s) in which this thread ran no Python code while another thread ran `call`,
    and the call's duration."""
    stamps, span = [], []

    def run():
        start = time.perf_counter()
        call()
        span[:] = [start, time.perf_counter()]
    worker = threading.Thread(target=run)
    worker.start()
    while worker.is_alive():
        stamps.append(time.perf_counter())
    worker.join()
    inside = [span[0]] + [s for s in stamps if span[0] < s < span[1]] + [span[1]]
    return max(b - a for a, b in zip(inside, inside[1:])), span[1] - span[0]


def test_python_runs_during_a_call():
    call = forward_call(2048)
    call()
    pause, duration = longest_pause(call)
    assert pause < 0.5 * duration, f"no Python ran for {pause:.3f} s of a {duration:.3f} s call"


def test_the_pause_check_fails_when_the_gil_is_held():
    call = forward_call(2048)
    call()
    debug.set_hold_gil(True)
    pause, duration = longest_pause(call)
    assert pause >= 0.7 * duration, f"with the GIL held, Python still ran: longest pause {pause:.3f} s of {duration:.3f} s"


def test_the_timing_check_fails_when_the_gil_is_held():
    debug.set_hold_gil(True)
    seq, par = timings(forward_call())
    assert par >= 0.9 * seq, f"with the GIL held two threads took {par:.3f} s, one after the other {seq:.3f} s"
