"""Sleeping on a word of shared memory (issue 30): the futex of the C helper across two
processes for real (woken, timed out, value changed), the queues' three ways of being
asleep (awake, on the socket, on the futex) without a lost wake-up, and the loader on it:
the same batches, no yielding, idle workers that use no CPU behind a slow loop."""

from __future__ import annotations

import os
import select
import threading
import time

import numpy as np
import pytest

from shmloader import DataLoader
from shmloader.epoch import collector as collector_module
from shmloader.system import slots
from shmloader.system.slots import FutexWord, Mapping, Wait
from shmloader.transport.channel import SLEEP_FUTEX, SLEEP_SOCKET, Channel

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not slots.HAS_FUTEX, reason="this build has no futex (Linux only)"),
]


def _shared_mapping() -> Mapping:
    """A fresh page of shared memory (a memfd, inherited by fork)."""
    fd = os.memfd_create("futex-test")
    os.ftruncate(fd, 4096)
    mapping = Mapping(fd, 4096)
    os.close(fd)
    return mapping


def _shared_word() -> FutexWord:
    """A word at offset 64 of a fresh shared mapping."""
    return FutexWord(_shared_mapping(), 64)


def _in_child(body) -> int:
    """Fork; the child runs ``body()`` and exits with its return value (0-255)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = body()
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_process_sleeping_on_the_word_is_woken_by_another():
    word = _shared_word()
    word.store(0)

    def sleeper() -> int:
        began = time.monotonic()
        how = word.wait(0, 30_000_000_000)  # 30 s: only a wake-up ends it in time
        return 1 if how is Wait.WOKEN and word.load() == 7 and time.monotonic() - began < 20 else 2

    pid = _in_child(sleeper)
    deadline = time.monotonic() + 20
    woke = 0
    while not woke and time.monotonic() < deadline:  # until the child is asleep on it
        time.sleep(0.01)
        word.store(7)
        woke = word.wake(1)
        if not woke:
            word.store(0)  # it was not asleep yet: let it sleep
    assert woke == 1
    assert _exit_code(pid) == 1


def test_a_wait_ends_at_its_timeout_or_at_once_when_the_value_changed():
    word = _shared_word()
    word.store(3)
    began = time.perf_counter()
    assert word.wait(3, 50_000_000) is Wait.TIMEOUT
    assert time.perf_counter() - began >= 0.045
    began = time.perf_counter()
    assert word.wait(4, 10_000_000_000) is Wait.CHANGED
    assert time.perf_counter() - began < 1.0
    assert word.wake(1) == 0, "nobody sleeps on it"
    with pytest.raises(ValueError, match="4-byte aligned"):
        FutexWord(_shared_mapping(), 2)


def test_a_thread_sleeping_on_the_word_leaves_the_others_running():
    """The call releases the GIL: a thread counts on while the main thread sleeps."""
    word = _shared_word()
    word.store(0)
    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.02)
        before = counted[0]
        assert word.wait(0, 200_000_000) is Wait.TIMEOUT
        during = counted[0] - before
    finally:
        stop.set()
        thread.join()
    assert during > 10_000, f"the other thread counted {during} while this one slept"


def _pair() -> tuple[Channel, Channel]:
    consumer = Channel.create()
    worker = Channel.attach(os.dup(consumer.fd), consumer.offset, consumer.size)  # type: ignore[arg-type]
    consumer.close_fd()
    return consumer, worker


def test_the_sleeping_word_says_how_to_wake_and_a_futex_sleeper_is_woken_with_no_byte():
    consumer, worker = _pair()
    # A worker asleep on its futex: the deferred wake-up is done by take_sleeper itself.
    assert worker.arm_tasks(SLEEP_FUTEX)
    assert consumer.push_task(1, 0, 0, b"") == 2, "deferred: still asleep"
    assert not consumer.take_sleeper(), "woken with FUTEX_WAKE: no byte to write"
    assert worker.sleep_tasks(1_000_000_000, 0), "a task is queued: it returns at once"
    worker.take_tasks()
    # Asleep on the socket: the byte is owed.
    assert worker.arm_tasks(SLEEP_SOCKET)
    assert consumer.push_task(1, 0, 1, b"") == 2
    assert consumer.take_sleeper() and not consumer.take_sleeper()
    worker.disarm_tasks()
    worker.take_tasks()
    # A frame rings a futex sleeper only.
    assert worker.arm_tasks(SLEEP_FUTEX)
    consumer.ring_tasks()
    began = time.perf_counter()
    assert not worker.sleep_tasks(5_000_000_000, 0), "rung: no task, back at once"
    assert time.perf_counter() - began < 1.0
    assert worker.arm_tasks(SLEEP_SOCKET)
    consumer.ring_tasks()
    assert consumer.push_task(1, 0, 2, b"") == 2, "a socket sleeper's word stays for the frame"
    worker.disarm_tasks()
    # Results: a worker's result wakes a futex sleeper itself (3), a socket sleeper is owed (2).
    assert consumer.arm_results(SLEEP_FUTEX)
    assert worker.push_result(11, 1, 5, 0, 1, 2, 3) == 3
    assert consumer.sleep_results(5_000_000_000, 0)
    assert consumer.arm_results(SLEEP_SOCKET) is False, "a result is queued"
    assert consumer.take_results() == [(11, 1, 5, 0, 1, 2, 3)]
    assert consumer.arm_results(SLEEP_SOCKET)
    assert worker.push_result(11, 2, 6, 0, 1, 2, 3) == 2
    consumer.disarm_results()
    # A timed-out sleep returns with nothing queued and the word cleared.
    consumer.take_results()
    assert consumer.arm_results(SLEEP_FUTEX)
    began = time.perf_counter()
    assert not consumer.sleep_results(30_000_000, 0)
    assert time.perf_counter() - began >= 0.025
    assert worker.push_result(11, 3, 7, 0, 1, 2, 3) == 1, "nobody asleep any more"


_WINDOW_NS = 10_000_000_000  # a lost wake-up would sleep this long


def _echo_worker(channel: Channel, wake_r: int, wake_w: int, seed: int) -> None:
    """A forked worker answering each task with (slot=the sum of its indices, seq); out of
    tasks it sleeps on its futex or its socket (``wake_r``), at random, and wakes the
    parent the way the parent's word says (a result; a byte on ``wake_w``)."""
    rng = np.random.default_rng(seed)
    while True:
        tasks = channel.take_tasks()
        if not tasks:
            spin = int(rng.choice([0, 0, 2_000]))
            if rng.random() < 0.8:
                if channel.arm_tasks(SLEEP_FUTEX):
                    began = time.monotonic()
                    channel.sleep_tasks(_WINDOW_NS, spin)
                    if time.monotonic() - began > 5:
                        os._exit(3)  # a lost wake-up
            elif channel.arm_tasks(SLEEP_SOCKET):
                data = os.read(wake_r, 1)
                channel.disarm_tasks()
                if not data:
                    os._exit(0)
            continue
        for kind, _slot, seq, _stamp, payload in tasks:
            if kind == 5:
                os._exit(0)
            total = int(np.frombuffer(payload, np.int64).sum())
            if channel.push_result(11, total, seq, 0, 0, 0, 0) == 2:
                os.write(wake_w, b"w")


def test_no_wake_up_is_lost_sleeping_on_the_futex_or_the_socket():
    """20,000 tasks through a forked echo worker; each side, out of work, sleeps on its
    futex (a 10 s window) or its socket at random, with or without a spin first; the
    parent defers wake-ups as the loader does. A lost wake-up is a sleep of seconds."""
    consumer, worker = _pair()
    to_worker = os.pipe()
    to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(to_worker[1])
        os.close(to_parent[0])
        _echo_worker(worker, to_worker[0], to_parent[1], 1)
    os.close(to_worker[0])
    os.close(to_parent[1])
    poller = select.poll()
    poller.register(to_parent[0], select.POLLIN)
    rng = np.random.default_rng(0)
    total, in_flight, seq, expected = 20_000, 0, 0, []
    answered = 0
    owed = False
    longest = 0.0

    def wake_worker() -> None:
        if consumer.take_sleeper():
            os.write(to_worker[1], b"w")

    try:
        while answered < total:
            while in_flight < 6 and seq < total:
                values = rng.integers(0, 1000, rng.integers(0, 41)).tolist()
                if consumer.push_task(1, 0, seq, np.asarray(values, np.int64).tobytes()) == 2:
                    owed = True
                expected.append(sum(values))
                seq += 1
                in_flight += 1
            if owed and (in_flight > 3 or seq == total):
                owed = False
                wake_worker()
            results = consumer.take_results()
            if not results:
                if owed:
                    owed = False
                    wake_worker()
                began = time.monotonic()
                if rng.random() < 0.7:
                    if consumer.arm_results(SLEEP_FUTEX):
                        consumer.sleep_results(_WINDOW_NS, int(rng.choice([0, 2_000])))
                elif consumer.arm_results(SLEEP_SOCKET):
                    assert poller.poll(_WINDOW_NS // 1_000_000), f"lost wake-up, {in_flight} in flight"
                    consumer.disarm_results()
                    os.read(to_parent[0], 64)
                longest = max(longest, time.monotonic() - began)
                assert longest < 5, f"a sleep lasted {longest:.1f} s: a lost wake-up"
                continue
            for _kind, answer, rseq, *_ in results:
                assert rseq == answered and answer == expected[rseq], "in order, each once"
                answered += 1
                in_flight -= 1
    finally:
        consumer.push_task(5, 0, 0, b"")
        wake_worker()
        os.close(to_worker[1])
        code = _exit_code(pid)
        os.close(to_parent[0])
    assert code == 0, "the worker slept through a wake-up" if code == 3 else f"worker exit {code}"


class _Numbers:
    def __len__(self) -> int:
        return 3000

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, i * i % 97], np.int64)


def _epochs(**kwargs) -> list[list[int]]:
    dl = DataLoader(
        _Numbers(),
        batch_size=3,
        shuffle=True,
        seed=5,
        num_workers=2,
        multiprocessing_context="fork",
        **kwargs,
    )
    return [[int(v) for b in dl for v in np.asarray(b).ravel()] for _ in range(2)]


def test_the_futex_path_gives_the_same_batches_as_the_socket_path(monkeypatch):
    with_futex = _epochs(persistent_workers=True)
    monkeypatch.setattr(slots, "HAS_FUTEX", False)  # (forked workers see it too)
    without = _epochs(persistent_workers=True)
    assert with_futex == without
    assert with_futex[0] != with_futex[1], "two shuffled epochs"


class _Slow:
    """Sample i is i, after ``delay`` s of sleep."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay)
        return i


@pytest.mark.timeout(60)
@pytest.mark.parametrize("busy", [True, False])
def test_a_consumer_waiting_for_slow_batches_sleeps_on_the_futex(request, monkeypatch, busy):
    """Waiting for 5 ms batches the consumer sleeps on the due worker's futex. On a busy
    machine it never yields its CPU first; on a quiet one it yields before it sleeps, for
    a window that halves with each long sleep (test_core.py counts it). Either way its CPU
    over 120 such waits stays far below what spinning through them would cost (600 ms)."""
    request.getfixturevalue("busy_machine" if busy else "quiet_machine")
    yields = [0]

    def counted() -> None:
        yields[0] += 1
        os.sched_yield()

    monkeypatch.setattr(collector_module, "yield_cpu", counted)
    dl = DataLoader(_Slow(120, 0.005), num_workers=1, persistent_workers=True, multiprocessing_context="fork")
    try:
        assert sum(1 for _ in dl) == 120
        began = time.process_time()
        first = yields[0]
        assert sum(1 for _ in dl) == 120
        spent = time.process_time() - began
    finally:
        dl.shutdown()
        del dl
    if busy:
        assert yields[0] == 0
    else:
        assert first > 0, "the consumer of a quiet machine yields before it sleeps"
    assert spent < 0.12, f"the consumer used {spent * 1e3:.1f} ms of CPU over 120 waits of 5 ms"


def _workers_cpu_behind_a_slow_step(step_s: float, seconds: float) -> tuple[float, float]:
    """(CPU seconds per worker per wall second, wall seconds) of 2 persistent workers
    behind a loop whose steps last ``step_s``."""
    psutil = pytest.importorskip("psutil")
    dl = DataLoader(
        _Numbers(), batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    try:
        for _ in dl:  # the workers start and settle
            pass
        workers = [psutil.Process(w.proc.pid) for w in dl.persistent_iterator.workers]
        before = sum(sum(w.cpu_times()[:2]) for w in workers)
        began = time.perf_counter()
        while time.perf_counter() - began < seconds:
            for _ in dl:
                time.sleep(step_s)
                if time.perf_counter() - began >= seconds:
                    break
        wall = time.perf_counter() - began
        spent = sum(sum(w.cpu_times()[:2]) for w in workers) - before
    finally:
        dl.shutdown()
    return spent / len(workers) / wall, wall


@pytest.mark.timeout(60)
def test_idle_workers_behind_a_slow_step_use_almost_no_cpu(quiet_machine):
    """Behind a 5 ms training step each worker is idle most of the time, asleep on its
    futex: it uses well under 10% of a core (the measured figure is in
    benchmarks/HISTORY.md), on a quiet machine too, where a worker yields before it
    sleeps until its long sleeps close the window."""
    share, wall = _workers_cpu_behind_a_slow_step(0.005, 1.5)
    assert share < 0.10, f"each worker used {share:.1%} of a core over {wall:.1f} s behind 5 ms steps"


def test_a_worker_woken_late_leaves_sched_batch_and_tries_it_again_later():
    """The policy tuner (in a forked child: the policy is the calling thread's): a round
    of late wake-ups puts it back under the normal policy when the consumer waited for a
    quarter of the round's results (not when it waited for fewer: the lateness cost it
    nothing), prompt ones keep SCHED_BATCH, RETRY_S later it tries SCHED_BATCH again; made
    under another policy (a worker_init_fn chose it) it changes nothing."""
    from shmloader.system.process import batch_policy_in_force, use_batch_policy, use_normal_policy
    from shmloader.workers import policy

    def child() -> int:
        if not use_batch_policy():
            return 7  # refused here: nothing to test
        tuner = policy.PolicyTuner()
        for _ in range(policy.ROUND):
            tuner.woke(50_000)  # prompt: stays
        if not (batch_policy_in_force() and tuner.batch):
            return 2
        for i in range(policy.ROUND):
            tuner.published(consumer_waited=i % 8 == 0)  # the consumer had batches in hand
            tuner.woke(5_000_000)  # late, behind sibling workers: it cost nothing
        if not (batch_policy_in_force() and tuner.batch):
            return 8
        for i in range(policy.ROUND):
            tuner.published(consumer_waited=i % 4 == 0)  # it waited for a quarter of them
            tuner.woke(5_000_000)  # 5 ms late: a busy machine
        if batch_policy_in_force() or tuner.batch:
            return 3
        tuner.woke(50_000)  # too soon to try again
        if batch_policy_in_force():
            return 4
        policy.RETRY_S = 0.0
        tuner.woke(50_000)
        if not (batch_policy_in_force() and tuner.batch):
            return 5
        use_normal_policy()
        other = policy.PolicyTuner()
        for _ in range(2 * policy.ROUND):
            other.woke(5_000_000)
        if other.active or batch_policy_in_force():
            return 6
        return 1

    code = _exit_code(_in_child(child))
    if code == 7:
        pytest.skip("SCHED_BATCH is refused here")
    assert code == 1, f"step {code} failed"
