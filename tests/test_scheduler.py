"""The scheduler on its own (no processes): round robin, in-order shares, reordering,
and the replay of the position for state_dict."""

from __future__ import annotations

import random

import pytest

from shmloader.epoch.scheduler import Scheduler
from shmloader.tuning.counts import WorkerCounts

END = 14  # the kind of an iterable worker's end
OK = 11


def _send(s: Scheduler, cap: int, in_flight: set[int]) -> list[tuple[int, int]]:
    """Send tasks until the scheduler or the cap stops it; (seq, worker) of each."""
    out = []
    while len(in_flight) + len(s.results) < cap:
        w = s.pick(cap)
        if w is None:
            break
        seq = s.assign(w)
        in_flight.add(seq)
        out.append((seq, w))
    return out


def test_strict_round_robin_in_order():
    s = Scheduler(WorkerCounts(3, 2), in_order=True, end_kind=END)
    sent = _send(s, 6, set())
    assert sent == [(i, i % 3) for i in range(6)]


def test_round_robin_starts_where_the_plan_says():
    s = Scheduler(WorkerCounts(3, 2), in_order=True, end_kind=END)
    s.begin_epoch(start_worker=2)
    assert [w for _, w in _send(s, 4, set())] == [2, 0, 1, 2]


def test_in_order_hands_out_by_batch_number_whatever_the_arrival_order():
    s = Scheduler(WorkerCounts(2, 2), in_order=True, end_kind=END)
    for w in (0, 1, 0, 1):
        s.assign(w)
    s.put(2, (OK, "b2"))
    s.put(1, (OK, "b1"))
    assert s.pop() is None  # batch 0 is due and has not come
    s.put(0, (OK, "b0"))
    assert [s.pop(), s.pop(), s.pop(), s.pop()] == [(OK, "b0"), (OK, "b1"), (OK, "b2"), None]
    assert s.handed_out() == 3 and s.due() == 3


def test_out_of_order_hands_out_in_arrival_order():
    s = Scheduler(WorkerCounts(2, 2), in_order=False, end_kind=END)
    for seq in (3, 1, 2):
        s.put(seq, (OK, seq))
    assert [s.pop(), s.pop(), s.pop(), s.pop()] == [(OK, 3), (OK, 1), (OK, 2), None]


def test_out_of_order_passes_over_a_worker_with_its_share_in_flight():
    """Worker 0 is slow: once it has cap/2 tasks in flight, it is skipped, and worker 1
    (answering at once) takes the others."""
    s = Scheduler(WorkerCounts(2, 2), in_order=False, end_kind=END)
    cap = 4
    in_flight: set[int] = set()
    owner = {}
    for seq, w in _send(s, cap, in_flight):
        owner[seq] = w
    assert sorted(owner.values()) == [0, 0, 1, 1]
    for _ in range(10):  # worker 1 answers everything at once, and is handed out
        for seq in [q for q in in_flight if owner[q] == 1]:
            in_flight.discard(seq)
            s.answered(1)
            s.put(seq, (OK, seq))
            assert s.pop() == (OK, seq)
        for seq, w in _send(s, cap, in_flight):
            owner[seq] = w
            assert w == 1, "worker 0 has its share in flight: it must be passed over"
    assert s.outstanding == [2, 2]


def test_in_order_does_not_pass_over_a_slow_worker():
    s = Scheduler(WorkerCounts(2, 2), in_order=True, end_kind=END)
    in_flight: set[int] = set()
    sent = _send(s, 4, in_flight)
    seq1 = [q for q, w in sent if w == 1]
    for q in seq1:  # worker 1 answers; worker 0 does not
        in_flight.discard(q)
        s.answered(1)
        s.put(q, (OK, q))
    assert s.pop() is None  # batch 0 (worker 0) is due
    assert [w for _, w in _send(s, 6, in_flight)] == [0, 1]  # still strict round robin


def test_ends_skip_the_worker_and_take_no_place_in_the_hand_out():
    s = Scheduler(WorkerCounts(2, 2), in_order=True, end_kind=END)
    in_flight: set[int] = set()
    _send(s, 4, in_flight)  # 0:w0 1:w1 2:w0 3:w1
    s.put(0, (OK, 0))
    s.put(1, (END, 1))
    s.ended(1, 1)
    s.put(2, (OK, 2))
    assert [s.pop(), s.pop(), s.pop()] == [(OK, 0), (OK, 2), None]
    assert s.any_active()
    assert s.pick(8) == 0 and s.pick(8) == 0  # worker 1 gets nothing more
    s.ended(0, 4)
    assert not s.any_active() and s.pick(8) is None


def test_retire_clears_a_worker():
    s = Scheduler(WorkerCounts(2, 2), in_order=True, end_kind=END)
    s.assign(1)
    s.assign(1)
    s.retire(1)
    assert s.outstanding == [0, 0] and s.active == [True, False]


def _simulate_iterable(n_workers: int, lengths: list[int], start: int, stop_after: int, rng: random.Random):
    """Run an iterable epoch through the scheduler, workers answering in random order;
    hand out ``stop_after`` results; the true per-worker counts and next worker."""
    s = Scheduler(WorkerCounts(n_workers, 2), in_order=True, end_kind=END)
    s.begin_epoch(start)
    produced = [0] * n_workers
    owner: dict[int, int] = {}
    in_flight: set[int] = set()
    handed: list[int] = []  # worker of each real batch handed out
    ends_handed = 0
    while len(handed) < stop_after:
        for seq, w in _send(s, 2 * n_workers, in_flight):
            owner[seq] = w
        if not in_flight:
            break
        seq = rng.choice(sorted(in_flight))
        if any(q < seq and owner[q] == owner[seq] for q in in_flight):
            seq = min(q for q in in_flight if owner[q] == owner[seq])  # a worker answers in order
        in_flight.discard(seq)
        w = owner[seq]
        s.answered(w)
        if produced[w] < lengths[w]:
            produced[w] += 1
            s.put(seq, (OK, w))
        else:
            s.ended(w, seq)
            s.put(seq, (END, w))
        while (item := s.pop()) is not None:
            handed.append(item[1])
            if len(handed) == stop_after:
                break
    counts = [handed.count(w) for w in range(n_workers)]
    return s, counts, handed, ends_handed


@pytest.mark.parametrize("seed", range(30))
def test_replay_counts_each_workers_batches_handed_out(seed):
    """The replay from the recorded ends gives exactly the batches each worker produced
    among those handed out, and the worker the next batch comes from (the first active
    one after the last handed-out batch's, in round robin)."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    lengths = [rng.randint(0, 6) for _ in range(n)]
    start = rng.randrange(n)
    stop_after = rng.randint(0, sum(lengths))
    s, counts, _, _ = _simulate_iterable(n, lengths, start, stop_after, rng)
    got_counts, next_worker = s.handed_out_per_worker()
    assert got_counts == counts, (lengths, start, stop_after)
    assert 0 <= next_worker < n


def test_shard_states_handed_out_keep_the_newest_done_one():
    s = Scheduler(WorkerCounts(2, 2), in_order=True, end_kind=END)
    for w in (0, 1, 0, 1):
        s.assign(w)
    s.keep_shard_state(0, 0, b"w0-after-0")
    s.keep_shard_state(1, 1, b"w1-after-1")
    s.keep_shard_state(0, 2, b"w0-after-2")
    assert s.shard_states_handed_out() == {}
    s.put(0, (OK, 0))
    s.put(1, (OK, 1))
    s.pop()
    assert s.shard_states_handed_out() == {0: b"w0-after-0"}
    s.pop()
    assert s.shard_states_handed_out() == {0: b"w0-after-0", 1: b"w1-after-1"}
    s.put(2, (OK, 2))
    s.pop()
    s.keep_shard_state(0, 4, b"w0-after-4")  # the one after 2 is now the oldest kept
    assert s.shard_states_handed_out()[0] == b"w0-after-2"


def test_results_dict_survives_epochs():
    s = Scheduler(WorkerCounts(1, 2), in_order=True, end_kind=END)
    results = s.results
    s.put(0, (OK, 0))
    s.begin_epoch()
    assert s.results is results and not results and s.send_seq == 0 and s.handed_out() == 0


def test_an_epoch_of_ends_only_yielded_nothing():
    """A resumed epoch whose shards were all at their end: every task came back an end
    (the iterator then begins the next epoch instead)."""
    s = Scheduler(WorkerCounts(2, 2), in_order=True, end_kind=END)
    assert s.yielded_nothing(), "nothing sent: nothing yielded"
    for seq, w in _send(s, 2, set()):
        s.answered(w)
        s.ended(w, seq)
        s.put(seq, (END,))
    assert s.pop() is None and s.yielded_nothing()
    s.begin_epoch()
    seq = s.assign(s.pick(2))
    s.answered(0)
    s.put(seq, (OK, "b0"))
    assert not s.yielded_nothing()


@pytest.mark.parametrize("in_order", [True, False])
def test_exhausted_once_every_worker_ended_and_only_ends_are_left(in_order):
    s = Scheduler(WorkerCounts(2, 2), in_order=in_order, end_kind=END)
    sent = _send(s, 4, set())  # 0, 2 to worker 0; 1, 3 to worker 1
    for seq, w in sent[:2]:
        s.answered(w)
        s.put(seq, (OK, seq))
    assert not s.exhausted(), "tasks in flight"
    for seq, w in sent[2:]:
        s.answered(w)
        s.ended(w, seq)
        s.put(seq, (END,))
    assert not s.exhausted(), "batches 0 and 1 not handed out yet"
    assert s.pop()[0] == OK and not s.exhausted()
    assert s.pop()[0] == OK and s.exhausted(), "the last batch is out: the next pop() ends the epoch"
    assert s.pop() is None and s.exhausted()


def test_a_worker_added_to_the_counts_joins_the_round_robin_at_its_next_turn():
    """The scheduler reads its worker count from the counts (it keeps no copy): a worker
    the tuner adds is picked from the round robin's next turn on, after ``grow()`` sized
    its own per-worker lists."""
    counts = WorkerCounts(2, 2)
    s = Scheduler(counts, in_order=True, end_kind=END)
    assert [s.pick(8) for _ in range(3)] == [0, 1, 0]
    counts.add_worker()
    s.grow()
    assert [s.pick(8) for _ in range(4)] == [1, 2, 0, 1]
    assert len(s.active) == len(s.outstanding) == 3


def test_counts_only_grow_through_their_methods():
    counts = WorkerCounts(1, 2)
    with pytest.raises(AttributeError):
        counts.workers = 5  # type: ignore[misc]
    assert (counts.add_worker(), counts.raise_prefetch()) == (2, 3)
    assert (counts.workers, counts.prefetch) == (2, 3)
    with pytest.raises(ValueError, match="no prefetch"):
        WorkerCounts(0, None).raise_prefetch()
