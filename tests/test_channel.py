"""A worker's channel (issue 15): task and result queues in shared memory with a sleeping
flag that never loses a wake-up, and the loader on them: frames and queued tasks in the
order they were sent, tiny and variable batches, tasks too large for the queue."""

from __future__ import annotations

import os
import select
import time

import numpy as np
import pytest

from shmloader import DataLoader
from shmloader.epoch import collector as collector_module
from shmloader.system import slots
from shmloader.transport.channel import MAX_TASK_PAYLOAD, TASK_WORDS, Channel
from shmloader.workers import worker as worker_module

pytestmark = pytest.mark.timeout(120)


def _pair() -> tuple[Channel, Channel]:
    """The consumer's and the worker's sides of one channel, in this process."""
    consumer = Channel.create()
    worker = Channel.attach(os.dup(consumer.fd), consumer.offset, consumer.size)  # type: ignore[arg-type]
    consumer.close_fd()
    return consumer, worker


def _indices(values: list[int]) -> bytes:
    return np.asarray(values, np.int64).tobytes()


def test_tasks_come_out_in_order_with_their_stamps_and_payloads_across_the_wrap():
    consumer, worker = _pair()
    sent = []
    # Records of varied length, enough to wrap around the end of the array several times.
    for seq in range(3 * TASK_WORDS // 40):
        payload = list(range(seq, seq + seq % 37))
        consumer.frames_sent = seq // 10
        assert consumer.push_task(1, seq % 8, seq, _indices(payload)) == 1
        sent.append((1, seq % 8, seq, seq // 10, payload))
        if seq % 5 == 4 or seq == 3 * TASK_WORDS // 40 - 1:
            tasks = worker.take_tasks()
            got = [(k, s, q, st, np.frombuffer(p, np.int64).tolist()) for k, s, q, st, p in tasks]
            assert got == sent
            sent = []
    assert worker.pending_tasks() == 0


def test_a_full_task_queue_refuses_a_task_and_takes_it_once_there_is_room():
    consumer, worker = _pair()
    big = _indices(list(range(MAX_TASK_PAYLOAD // 8)))
    pushed = 0
    while consumer.push_task(1, 0, pushed, big):
        pushed += 1
    assert pushed == TASK_WORDS // (5 + MAX_TASK_PAYLOAD // 8)
    assert consumer.push_task(1, 0, pushed, b"") == 1, "a small one still fits in the rest"
    assert len(worker.take_tasks()) == pushed + 1
    assert consumer.push_task(1, 0, 99, big) == 1


def test_sleeping_flags_say_who_to_wake_once():
    consumer, worker = _pair()
    # Tasks: a worker that armed on an empty queue sleeps; a task then says so, and the
    # wake-up is owed until take_sleeper (once).
    assert worker.arm_tasks()
    assert consumer.push_task(1, 0, 0, b"") == 2
    assert consumer.push_task(1, 0, 1, b"") == 2, "deferred: still asleep"
    assert consumer.take_sleeper() and not consumer.take_sleeper()
    assert not worker.arm_tasks(), "tasks are queued: it must not sleep"
    assert consumer.push_task(1, 0, 2, b"") == 1
    worker.take_tasks()
    worker.arm_tasks()
    worker.disarm_tasks()  # woke for another reason (a frame)
    assert consumer.push_task(1, 0, 3, b"") == 1
    # Results: the worker wakes a sleeping consumer once.
    assert consumer.arm_results()
    assert worker.push_result(11, 1, 5, 0, 1, 2, 3) == 2
    assert worker.push_result(11, 2, 6, 3, 4, 5, 6) == 1
    assert not consumer.arm_results()
    assert consumer.take_results() == [(11, 1, 5, 0, 1, 2, 3), (11, 2, 6, 3, 4, 5, 6)]
    assert consumer.take_results() == []


def _echo_worker(channel: Channel, wake_r: int, wake_w: int) -> None:
    """A worker in a forked child: answers every task with (slot=its sum, seq), sleeping
    on ``wake_r`` when the queue is empty and waking the parent through ``wake_w``."""
    while True:
        tasks = channel.take_tasks()
        if not tasks:
            if channel.arm_tasks():
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


def test_no_wake_up_is_lost_between_two_processes():
    """20,000 tasks of 0-40 indices through a forked echo worker; the parent defers wake-ups
    as the loader does and sleeps in poll whenever it has nothing; a lost wake-up would
    hang a poll past its deadline."""
    consumer, worker = _pair()
    to_worker = os.pipe()
    to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(to_worker[1])
        os.close(to_parent[0])
        _echo_worker(worker, to_worker[0], to_parent[1])
    os.close(to_worker[0])
    os.close(to_parent[1])
    poller = select.poll()
    poller.register(to_parent[0], select.POLLIN)
    rng = np.random.default_rng(0)
    total, in_flight, seq, expected = 20_000, 0, 0, []
    answered = 0
    owed = False
    try:
        while answered < total:
            while in_flight < 6 and seq < total:
                values = rng.integers(0, 1000, rng.integers(0, 41)).tolist()
                if consumer.push_task(1, 0, seq, _indices(values)) == 2:
                    owed = True
                expected.append(sum(values))
                seq += 1
                in_flight += 1
            if owed and (in_flight > 3 or seq == total):
                owed = False
                if consumer.take_sleeper():
                    os.write(to_worker[1], b"w")
            results = consumer.take_results()
            if not results:
                if owed:
                    owed = False
                    if consumer.take_sleeper():
                        os.write(to_worker[1], b"w")
                if consumer.arm_results():
                    assert poller.poll(5000), f"lost wake-up with {in_flight} tasks in flight"
                    consumer.disarm_results()
                    os.read(to_parent[0], 64)
                continue
            for _kind, answer, rseq, *_ in results:
                assert rseq == answered and answer == expected[rseq], "in order, each once"
                answered += 1
                in_flight -= 1
    finally:
        consumer.push_task(5, 0, 0, b"")
        if consumer.take_sleeper():
            os.write(to_worker[1], b"w")
        os.close(to_worker[1])
        os.waitpid(pid, 0)
        os.close(to_parent[0])


class _Echo:
    """Sample i is ``[i, i % 7]``: a batch's size varies with its indices' count."""

    def __init__(self, length: int = 200_000) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, i % 7], np.int64)


class _Sizes:
    """Batches of varied size, a few larger than the task queue takes (they go by frame,
    between queued ones) and growing (new rings mid-epoch)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self):
        start = 0
        for n in self.sizes:
            yield list(range(start, start + n))
            start += n

    def __len__(self) -> int:
        return len(self.sizes)


@pytest.mark.parametrize("in_order", [True, False])
def test_variable_batches_queued_and_framed_come_back_whole(in_order):
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 12, 600).tolist()
    big = MAX_TASK_PAYLOAD // 8 + 1  # one index more than the queue takes
    for at, n in ((50, big), (51, 3), (300, 2 * big), (301, 1), (302, big)):
        sizes[at] = n
    dl = DataLoader(_Echo(), batch_sampler=_Sizes(sizes), num_workers=2, in_order=in_order)
    got = [(int(b[0, 0]), len(b), bool((np.diff(b[:, 0]) == 1).all())) for b in dl]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    expected = list(zip(starts, sizes, [True] * len(sizes)))
    assert got == expected if in_order else sorted(got) == expected


class _KeyDataset:
    def __getitem__(self, key):
        return np.array([len(str(key))])

    def __len__(self) -> int:
        return 10


def test_keys_that_are_not_ints_go_by_frame_in_order_with_queued_tasks():
    """A batch sampler mixing int batches (queued) and str-key batches (pickled frames)."""
    batches = [[0, 1], ["a", "bb"], [2], ["ccc"], [3, 4, 5]] * 20
    dl = DataLoader(_KeyDataset(), batch_sampler=batches, num_workers=2)
    got = [b.ravel().tolist() for b in dl]
    assert got == [[len(str(k)) for k in batch] for batch in batches]


def test_persistent_workers_take_queued_tasks_across_epochs():
    dl = DataLoader(_Echo(30), batch_size=3, num_workers=2, persistent_workers=True)
    for _ in range(3):
        assert [int(b[0, 0]) for b in dl] == list(range(0, 30, 3))


def _workers_cpu_over_slow_steps(steps: int) -> float:
    """Seconds of CPU the two workers of a warm loader use over ``steps`` steps of 2 ms."""
    psutil = pytest.importorskip("psutil")
    dl = DataLoader(
        _Echo(steps), batch_size=1, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    try:
        for _ in dl:  # the workers start, and learn the loop is fast
            pass
        workers = [psutil.Process(w.proc.pid) for w in dl.persistent_iterator.workers]
        assert len(workers) == 2
        before = sum(sum(w.cpu_times()[:2]) for w in workers)
        count = 0
        for _ in dl:
            time.sleep(0.002)
            count += 1
        spent = sum(sum(w.cpu_times()[:2]) for w in workers) - before
    finally:
        dl.shutdown()  # (a failed assertion's traceback would keep the workers alive)
    assert count == steps
    return spent


@pytest.mark.parametrize("futex", [True, False])
def test_idle_workers_stop_yielding_the_cpu_when_the_loop_is_slow(monkeypatch, quiet_machine, futex):
    """Out of tasks, a worker of a quiet machine yields its CPU, looking for a task,
    before it sleeps (on its futex, or its socket where there is none: the consumer then
    owes it no wake-up); a loop whose steps last milliseconds must not pay that on every
    batch: each long sleep halves the window, down to none. Side by side with workers
    that never yield (forked: they see the patched window): 600 steps yielding 200 us each
    would cost the two workers ~120 ms more."""
    if futex and not slots.HAS_FUTEX:
        pytest.skip("no futex in this build")
    monkeypatch.setattr(slots, "HAS_FUTEX", futex)  # (forked workers see it)
    adaptive = _workers_cpu_over_slow_steps(600)
    monkeypatch.setattr(worker_module, "SPIN_MAX_NS", 0)
    never = _workers_cpu_over_slow_steps(600)
    assert adaptive < never + 0.06, (
        f"idle workers used {adaptive * 1e3:.0f} ms of CPU over 600 slow steps, "
        f"{never * 1e3:.0f} ms when they never yield"
    )


@pytest.mark.parametrize("futex", [True, False])
def test_a_task_by_frame_ends_a_workers_wait_at_once(monkeypatch, quiet_machine, futex):
    """A worker waiting for a task also looks at its socket: a task that comes by frame
    (keys that are not ints) is taken at once, not when the wait's window ends. Asleep on
    its futex, the frame's ring wakes it (with a 5 s window, forked workers see it);
    yielding (no futex, a quiet machine), it polls its socket between yields (a 50 ms
    window). 100 one-key batches would take over 1 s if each worker waited its window
    out; a yield that hands the CPU to a busy machine's other processes costs about a time
    slice (~1 ms) a batch."""
    if futex:
        if not slots.HAS_FUTEX:
            pytest.skip("no futex in this build")
        monkeypatch.setattr(worker_module, "SLEEP_WINDOW_NS", 5_000_000_000)
        monkeypatch.setattr(collector_module, "SLEEP_WINDOW_NS", 5_000_000_000)
    else:
        monkeypatch.setattr(slots, "HAS_FUTEX", False)  # the yielding path (forked workers see it)
        monkeypatch.setattr(worker_module, "SPIN_MAX_NS", 50_000_000)
    dl = DataLoader(
        _KeyDataset(),
        batch_sampler=[[str(i)] for i in range(100)],
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    try:
        began = time.perf_counter()
        assert sum(1 for _ in dl) == 100
        # The first batch of each worker comes by frame: its ring wakes the consumer.
        first = time.perf_counter() - began
        times = []
        for _ in range(3):
            began = time.perf_counter()
            assert sum(1 for _ in dl) == 100
            times.append(time.perf_counter() - began)
    finally:
        dl.shutdown()
    assert min(times) < 0.3, f"100 batches whose tasks came by frame took {min(times):.2f} s"
    assert first < 4, f"the first epoch, its first batches by frame, took {first:.1f} s"
