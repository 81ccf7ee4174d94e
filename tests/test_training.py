"""Training integration (issue 7): torch tensors, pinned memory, sharding across ranks,
exact and elastic resume, per-sample random generators.

Multi-worker cases run under fork (cheap on 2 cores); one resume case runs under spawn
too, since the resume record then travels pickled in the worker's config."""

from __future__ import annotations

import gc
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import shmloader
from shmloader import DataLoader, Dataset, IterableDataset, get_shard_info, get_worker_info, sample_rng
from shmloader.batch import pinning
from shmloader.system import slots as _slots

from . import datasets as D

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORK = {"multiprocessing_context": "fork"}


# --- datasets (module level, so spawn can pickle them) ----------------------------------


class Augmented(Dataset):
    """Sample i: its index and a 'random augmentation' drawn from sample_rng(i)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"index": i, "aug": sample_rng(i).integers(0, 2**31, 3)}


class Stream(IterableDataset):
    """Yields 0..n-1 split across every worker of every rank by the global shard id."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        info = get_shard_info()
        for v in range(info.shard_id, self.n, info.num_shards):
            yield {"value": v, "shard": info.shard_id, "aug": sample_rng(v).integers(0, 1000)}


class StatefulStream(Stream):
    """Stream that saves its own position (so resuming never rereads samples)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.pos = 0  # samples yielded by the current iterator
        self.start = 0  # where the next iterator starts (load_state_dict)
        self.resumed_at = None

    def shmloader_state_dict(self):
        return {"pos": self.pos}

    def shmloader_load_state_dict(self, state):
        self.start = state["pos"]

    def __iter__(self):
        info = get_shard_info()
        mine = range(info.shard_id, self.n, info.num_shards)
        self.pos, self.start = self.start, 0
        resumed = self.pos
        for v in mine[self.pos :]:
            self.pos += 1
            yield {"value": v, "shard": info.shard_id, "resumed_at": resumed}


class ShardEcho(IterableDataset):
    """One sample per worker: what its worker info says."""

    def __iter__(self):
        info = get_worker_info()
        yield np.array([info.id, info.rank, info.world_size, info.shard_id, info.num_shards])


class BothRngs(Dataset):
    """Sample i: shmloader.sample_rng's draw and shmloader.vision.sample_rng's."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        from shmloader.vision import sample_rng as vision_rng

        return np.array([sample_rng(i).integers(0, 2**62), vision_rng(i).integers(0, 2**62)])


def batches(loader_or_iter):
    """Every batch as plain lists: indices and augmentations."""
    return [(b["index"].tolist(), b["aug"].tolist()) for b in loader_or_iter]


def stream_values(loader_or_iter):
    return [b["value"].tolist() for b in loader_or_iter]


def checkpoint_roundtrip(state):
    """What a torch checkpoint gives back (weights_only: plain data only)."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["loader"]


# --- torch interop ------------------------------------------------------------------------


def test_output_torch_gives_tensors_sharing_the_slot():
    torch = pytest.importorskip("torch")
    dl = DataLoader(D.Squares(200), batch_size=4, num_workers=2, output="torch", **FORK)
    kept = None
    for n, (x, y) in enumerate(dl):
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and y.dtype == torch.int64
        assert torch.equal(x[:, 0, 0], y.float())
        if n >= 2:  # the first batch of each worker sizes the ring and comes by copy
            assert dl.ring.contains(x.numpy()), "no copy: the tensor views the slot"
        if n == 5:
            kept = x[1:3, 0]  # a tensor slice keeps the slot leased, as a numpy view does
        if kept is not None:
            assert (kept == torch.tensor([[21.0] * 4, [22.0] * 4])).all(), f"slot reused at {n}"
    main = list(DataLoader(D.Squares(12), batch_size=4, output="torch"))
    assert all(isinstance(x, torch.Tensor) for x, _ in main)
    assert [y.tolist() for _, y in main] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_tensor_samples_are_written_into_slots_and_come_back_as_tensors():
    torch = pytest.importorskip("torch")
    for output in ("numpy", "torch"):
        out = list(DataLoader(D.TorchSamples(), batch_size=2, num_workers=2, output=output, **FORK))
        assert all(isinstance(x, torch.Tensor) for x, _ in out)
        assert [x[:, 0, 0].tolist() for x, _ in out] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    with pytest.raises(ValueError, match="output should be 'auto', 'numpy' or 'torch'"):
        DataLoader(D.Squares(), output="jax")


# --- pin memory ---------------------------------------------------------------------------


def test_pin_memory_without_cuda_warns_once_and_loads():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the no-CUDA fallback does not apply")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dl = DataLoader(D.Squares(20), batch_size=5, num_workers=2, pin_memory=True, **FORK)
        assert [int(v) for _ in range(2) for _, y in dl for v in y] == list(range(20)) * 2
    texts = [str(w.message) for w in caught]
    assert texts.count(pinning.NO_CUDA_WARNING) == 1, texts
    assert dl.runtime.pinner is None


class FakeEvent:
    def __init__(self):
        self.complete = False


class FakeHost:
    """Stands in for CudaHost (the CUDA seam) on machines without a GPU."""

    def __init__(self):
        self.registered, self.unregistered, self.events, self.waits = [], [], [], 0

    def register(self, address, size):
        self.registered.append((address, size))

    def unregister(self, address):
        self.unregistered.append(address)

    def record(self):
        self.events.append(FakeEvent())
        return self.events[-1]

    def done(self, event):
        return event.complete

    def wait(self, event):
        self.waits += 1
        event.complete = True


def assert_pending_slots_held(pinner):
    """Every released slot whose copies may still run stays leased (HELD)."""
    for event, states, slot in pinner.waiting():
        if not event.complete:
            assert states.load(slot) == _slots.HELD


def test_pinned_ring_is_registered_once_and_slots_wait_for_their_copies(monkeypatch):
    host = FakeHost()
    monkeypatch.setattr(
        pinning, "make_pinner", lambda pin, stacklevel=3: pinning.RingPinner(host) if pin else None
    )
    dl = DataLoader(D.Squares(120), batch_size=4, num_workers=2, pin_memory=True, slot_bytes=4096, **FORK)
    ring = dl.ring
    address, size = ring.mapping.address, ring.mapping.size
    assert host.registered == [(address, size)], "the whole ring, registered once"
    pinner = dl.runtime.pinner
    labels = []
    for x, y in dl:
        labels.extend(y.tolist())
        assert (x[:, 0, 0] == y).all()
        del x, y
        assert_pending_slots_held(pinner)
    assert labels == list(range(120))
    assert host.registered == [(address, size)], "no registration per batch"
    assert host.waits > 0, "the loader waited for pending copies instead of reusing their slots"
    assert len(host.events) == 30, "one event per batch, recorded when the batch died"
    for event in host.events:
        event.complete = True
    pinner.reclaim()
    assert pinner.pending == 0
    del dl, ring
    gc.collect()
    assert host.unregistered == [address], "unregistered before the ring is unmapped"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_pinned_ring_copies_to_cuda_straight_from_the_slot():  # runs on a GPU machine only
    import torch

    # slot_bytes: the ring is registered before the workers fork (they must still map it).
    dl = DataLoader(
        D.Wide(),
        batch_size=64,
        num_workers=2,
        pin_memory=True,
        slot_bytes=2**20,
        output="torch",
        sampler=range(2048),
        **FORK,
    )
    assert dl.runtime.pinner is not None
    for _ in range(2):  # two epochs: new workers forked after the registration
        out = []
        for x in dl:
            assert x.is_pinned(), "the slot is page-locked: no pinned copy"
            out.append(x.to("cuda", non_blocking=True))  # x dies now: the slot waits for the copy
        torch.cuda.synchronize()
        assert [int(b[i, 0]) for b in out for i in range(64)] == list(range(2048))
        assert all(bool((b == b[:, :1]).all()) for b in out), "no slot was rewritten mid-copy"


# --- sharding across ranks ----------------------------------------------------------------


def labels_of(loader):
    return [[int(v) for v in b[1]] for b in loader]


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_take_disjoint_shares_of_each_epoch_with_equal_batch_counts(drop_last):
    n, world, size = 50, 3, 4
    loaders = [
        DataLoader(
            D.Squares(n),
            batch_size=size,
            shuffle=True,
            seed=4,
            drop_last=drop_last,
            rank=r,
            world_size=world,
            num_workers=2 if r == 1 else 0,
            **(FORK if r == 1 else {}),
        )
        for r in range(world)
    ]
    previous = None
    for epoch in range(2):
        per_rank = [labels_of(dl) for dl in loaders]
        counts = {len(b) for b in per_rank}
        assert counts == {len(loaders[0])}, "every rank gets the same number of batches"
        flat = [v for b in per_rank for batch in b for v in batch]
        if drop_last:
            assert len(flat) == len(set(flat)) == n // (world * size) * world * size
            assert all(len(batch) == size for b in per_rank for batch in b)
        else:
            assert set(flat) == set(range(n)) and len(flat) == 51, "50 samples + 1 wrapped pad"
        if epoch == 0:  # the shares are the global order split as DistributedSampler does
            whole = DataLoader(D.Squares(n), batch_size=1, shuffle=True, seed=4, distributed=False)
            order = [b[0] for b in labels_of(whole)]
            padded = order + order[:1]
            mine = padded[0::world]
            expect = [mine[i : i + size] for i in range(0, len(mine), size)]
            if not drop_last:
                assert per_rank[0] == expect
        if epoch == 1:
            assert per_rank != previous, "a new order every epoch"
        previous = per_rank


def test_batch_sampler_shards_by_batches_and_distributed_sampler_is_not_resharded():
    torch = pytest.importorskip("torch")
    from shmloader import BucketBatchSampler

    lengths = [i % 7 + 1 for i in range(40)]
    per_rank = []
    for r in range(2):
        bucket = BucketBatchSampler(lengths, batch_size=4, seed=3)
        per_rank.append(labels_of(DataLoader(D.Squares(40), batch_sampler=bucket, rank=r, world_size=2)))
    whole = list(BucketBatchSampler(lengths, batch_size=4, seed=3))
    assert len(per_rank[0]) == len(per_rank[1]) and per_rank[0] + per_rank[1] != whole
    assert sorted(map(sorted, per_rank[0] + per_rank[1])) == sorted(map(sorted, whole))
    sampler = torch.utils.data.DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=False)
    dl = DataLoader(D.Squares(40), batch_size=5, sampler=sampler, rank=1, world_size=2)
    assert len(dl) == 4 and labels_of(dl) == [list(range(1, 40, 2))[i : i + 5] for i in range(0, 20, 5)]


def test_rank_and_world_size_detection(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dl = DataLoader(D.Squares(10), distributed="auto")
    assert (dl.rank, dl.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    dl = DataLoader(D.Squares(10), batch_size=2, distributed="auto")
    assert (dl.rank, dl.world_size) == (2, 4) and len(dl) == 2  # 10 -> pad 12 -> 3 each -> 2
    assert DataLoader(D.Squares(10), batch_size=2, distributed=True).world_size == 4
    default = DataLoader(D.Squares(10), batch_size=2)
    assert (default.distributed, default.rank, default.world_size, len(default)) == (False, 0, 1, 5)
    assert DataLoader(D.Squares(10), rank=1, world_size=2).rank == 1, "explicit wins"
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="distributed=True but neither"):
        DataLoader(D.Squares(10), distributed=True)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        DataLoader(D.Squares(10), rank=4, world_size=4)
    with pytest.raises(ValueError, match="distributed should be"):
        DataLoader(D.Squares(10), distributed="yes")


RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from shmloader import DataLoader
    from tests.datasets import Squares
    dl = DataLoader(Squares(21), batch_size=4, shuffle=True, seed=3, num_workers=1, distributed="auto")
    dl.set_epoch(int(sys.argv[1]))
    print(json.dumps([[int(v) for v in y] for _, y in dl]))
    """
)


def test_subprocess_ranks_from_rank_and_world_size_env():
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, "7"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"},
        )
        for r in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(outs[0]) == len(outs[1]) == 3  # 21 -> pad 22 -> 11 per rank -> 4+4+3
    flat = [v for out in outs for b in out for v in b]
    assert set(flat) == set(range(21)) and len(flat) == 22


DIST_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from shmloader import DataLoader
    from tests.datasets import Squares
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dl = DataLoader(Squares(23), batch_size=4, shuffle=True, seed=3, num_workers=1, distributed="auto")
    seen = []
    for _, y in dl:
        total = torch.tensor([len(y)])
        dist.all_reduce(total)  # would hang if one rank ran out of batches first
        seen.append([int(v) for v in y])
    # Not asked to shard: every sample on every rank, as torch's loader without a
    # DistributedSampler; a DataPipe is sharded by the process group, as torch does it.
    default = DataLoader(Squares(23), batch_size=4, num_workers=1)
    whole = sorted(int(v) for _, y in default for v in y)
    theirs = sorted(int(v) for _, y in torch.utils.data.DataLoader(Squares(23), batch_size=4) for v in y)
    from torch.utils.data.datapipes.iter import IterableWrapper
    pipe = IterableWrapper(range(10)).sharding_filter()
    pipes = {
        f"{name}{nw}": [int(v) for v in cls(pipe, batch_size=None, num_workers=nw)]
        for name, cls in (("ours", DataLoader), ("torch", torch.utils.data.DataLoader))
        for nw in (0, 1)
    }
    print(json.dumps({
        "rank": dl.rank, "world": dl.world_size, "seen": seen, "whole": whole, "theirs": theirs,
        "default": [default.rank, default.world_size], "pipes": pipes,
    }))
    dist.destroy_process_group()
    """
)


def test_torch_distributed_ranks_shard_and_stay_in_step():
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DIST_SCRIPT, str(r), str(port)], cwd=REPO, stdout=subprocess.PIPE, env=env
        )
        for r in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=90)[0]) for p in procs]
    assert [(o["rank"], o["world"]) for o in outs] == [(0, 2), (1, 2)], "detected from torch.distributed"
    flat = [v for o in outs for b in o["seen"] for v in b]
    assert set(flat) == set(range(23)) and len(flat) == 24
    for k, o in enumerate(outs):
        assert o["whole"] == o["theirs"] == list(range(23)), f"rank {k}: a default loader shards nothing"
        assert o["default"] == [0, 1]
        want = list(range(k, 10, 2))
        assert {name: sorted(v) for name, v in o["pipes"].items()} == dict.fromkeys(o["pipes"], want), (
            f"rank {k}: a DataPipe is sharded by the process group, as torch's loader shards it"
        )


def test_set_epoch_and_automatic_epochs():
    def loader():
        return DataLoader(D.Squares(30), batch_size=5, shuffle=True, seed=9, rank=0, world_size=2)

    auto = loader()
    e0, e1, e2 = labels_of(auto), labels_of(auto), labels_of(auto)
    assert len({str(e0), str(e1), str(e2)}) == 3
    chosen = loader()
    chosen.set_epoch(2)
    assert labels_of(chosen) == e2
    chosen.set_epoch(2)
    assert labels_of(chosen) == e2, "same epoch, same share, as DistributedSampler"
    assert labels_of(chosen) == labels_of(auto), "then epoch 3, counting on by itself"


def test_iterable_worker_info_has_rank_and_global_shards():
    dl = DataLoader(ShardEcho(), batch_size=None, num_workers=2, rank=1, world_size=3, **FORK)
    rows = sorted(tuple(int(v) for v in b) for b in dl)
    assert rows == [(0, 1, 3, 2, 6), (1, 1, 3, 3, 6)]  # id, rank, world, shard_id, num_shards
    # Files split across all workers of all ranks: every value exactly once.
    values = []
    for r in range(2):
        dl = DataLoader(Stream(40), batch_size=3, num_workers=2, rank=r, world_size=2, **FORK)
        values += [v for b in dl for v in b["value"].tolist()]
    assert sorted(values) == list(range(40))


# --- per-sample random generator ----------------------------------------------------------


def test_sample_rng_is_the_same_whichever_worker_and_new_each_epoch():
    def epochs(num_workers):
        kw = FORK if num_workers else {}
        dl = DataLoader(Augmented(24), batch_size=4, shuffle=True, seed=1, num_workers=num_workers, **kw)
        draws = []
        for _ in range(2):  # sample index -> its augmentation, per epoch
            draws.append({i: tuple(a) for idx, aug in batches(dl) for i, a in zip(idx, aug)})
        return draws

    zero, three = epochs(0), epochs(3)
    assert zero == three, "same draws for each sample with 0 or 3 workers"
    assert zero[0] != zero[1], "new draws every epoch"
    np.random.seed(5)
    a = sample_rng(3).random()
    np.random.seed(5)
    assert sample_rng(3).random() == a, "outside a loader: follows np.random.seed"


def test_vision_sample_rng_matches():
    pytest.importorskip("shmloader.vision")
    for kw in ({}, {"num_workers": 2, **FORK}):
        for row in DataLoader(BothRngs(), batch_size=None, seed=2, **kw):
            assert row[0] == row[1]


# --- exact resume -------------------------------------------------------------------------


def stop_after(loader, k):
    it = iter(loader)
    first = [next(it) for _ in range(k)]
    state = loader.state_dict()
    return first, state, it


@pytest.mark.parametrize("before, after", [(2, 3), (0, 2), (3, 0)])
def test_resume_mid_epoch_yields_exactly_the_rest(before, after):
    kw = lambda w: {"num_workers": w, **(FORK if w else {})}  # noqa: E731
    reference = DataLoader(Augmented(50), batch_size=4, shuffle=True, seed=5, **kw(2))
    epoch0, epoch1 = batches(reference), batches(reference)

    dl = DataLoader(Augmented(50), batch_size=4, shuffle=True, seed=5, **kw(before))
    first, state, it = stop_after(dl, 5)
    first = batches(first)
    del it
    state = checkpoint_roundtrip(state)
    assert state["epoch"] == 0 and state["consumed"] == 20

    fresh = DataLoader(Augmented(50), batch_size=4, shuffle=True, **kw(after))  # no seed: the state's
    fresh.load_state_dict(state)
    assert fresh.state_dict()["consumed"] == 20, "loaded, not iterated: the loaded position"
    assert first + batches(fresh) == epoch0
    assert batches(fresh) == epoch1, "the next epoch follows as in the uninterrupted run"


def test_resume_with_set_epoch_and_persistent_workers():
    kw = {"num_workers": 2, "persistent_workers": True, **FORK}
    reference = DataLoader(Augmented(30), batch_size=4, shuffle=True, seed=8, num_workers=0)
    reference.set_epoch(3)
    epoch3 = batches(reference)
    dl = DataLoader(Augmented(30), batch_size=4, shuffle=True, seed=8, **kw)
    dl.set_epoch(3)
    first, state, it = stop_after(dl, 3)
    first = batches(first)
    fresh = DataLoader(Augmented(30), batch_size=4, shuffle=True, **kw)
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # a training loop calls it every epoch: the loaded position stays
    assert first + batches(fresh) == epoch3
    del it
    dl.shutdown()
    fresh.shutdown()


def test_state_between_epochs_and_errors():
    dl = DataLoader(Augmented(12), batch_size=4, shuffle=True, seed=1)
    assert dl.state_dict()["epoch"] == 0 and dl.state_dict()["consumed"] == 0
    batches(dl)
    state = dl.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0), "a finished epoch: the next one"
    with pytest.raises(ValueError, match="dataset of 12 samples"):
        DataLoader(Augmented(13), batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="made by shmloader"):
        dl.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="in_order=True"):
        loader = DataLoader(Augmented(12), batch_size=2, num_workers=2, in_order=False, **FORK)
        stop_after(loader, 1)


def test_elastic_resume_two_to_four_ranks_loses_and_repeats_nothing():
    n = 100
    old = [
        DataLoader(
            Augmented(n),
            batch_size=8,
            shuffle=True,
            seed=6,
            rank=r,
            world_size=2,
            num_workers=r,
            **(FORK if r else {}),
        )
        for r in range(2)
    ]
    consumed, states = [], []
    its = []
    for dl in old:
        first, state, it = stop_after(dl, 3)  # 3 global steps of 16 samples
        consumed += [i for b in batches(first) for i in b[0]]
        states.append(state)
        its.append(it)
    del its
    assert states[0]["consumed"] == states[1]["consumed"] == 48, "the same state on every rank"
    new = [
        DataLoader(
            Augmented(n),
            batch_size=4,
            shuffle=True,
            rank=r,
            world_size=4,
            num_workers=1 if r == 3 else 0,
            **(FORK if r == 3 else {}),
        )
        for r in range(4)
    ]
    rest = []
    for dl in new:
        dl.load_state_dict(checkpoint_roundtrip(states[0]))
        rest.append(batches(dl))
    assert len({len(b) for b in rest}) == 1, "equal batch counts on the new ranks"
    remaining = [i for b in rest for batch in b for i in batch[0]]
    assert len(set(consumed)) == len(consumed) == 48
    assert set(consumed) | set(remaining) == set(range(n)) and not set(consumed) & set(remaining)
    assert len(remaining) == n - 48, "52 left, a multiple of 4: no padding, nothing repeated"
    # The augmentations depend on the sample only, not on the rank that loaded it.
    reference = {
        i: a
        for b in batches(DataLoader(Augmented(n), batch_size=10, shuffle=True, seed=6))
        for i, a in zip(*b)
    }
    assert all(reference[i] == a for b in rest for batch in b for i, a in zip(*batch))


# --- iterable datasets ------------------------------------------------------------------


@pytest.mark.parametrize("stateful", [True, False])
@pytest.mark.parametrize("stop", [5, 11])  # 11: some workers already ran out
def test_iterable_resume_per_shard(stateful, stop):
    cls = StatefulStream if stateful else Stream
    reference = stream_values(DataLoader(cls(44), batch_size=4, num_workers=3, seed=2, **FORK))
    dl = DataLoader(cls(44), batch_size=4, num_workers=3, seed=2, **FORK)
    first, state, it = stop_after(dl, stop)
    first = stream_values(first)
    del it
    state = checkpoint_roundtrip(state)
    fresh = DataLoader(cls(44), batch_size=4, num_workers=3, **FORK)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state_dict(state)
    fast_forward = [w for w in caught if "fast-forwarding" in str(w.message)]
    assert len(fast_forward) == (0 if stateful else 1)
    rest = list(fresh)
    assert first + stream_values(rest) == reference
    if stateful:
        assert any(int(b["resumed_at"][0]) > 0 for b in rest), "the dataset's own state was loaded"
    with pytest.raises(ValueError, match="same rank, world size and num_workers"):
        DataLoader(cls(44), batch_size=4, num_workers=2).load_state_dict(state)


def test_iterable_resume_record_travels_to_spawned_workers():
    reference = stream_values(DataLoader(Stream(30), batch_size=4, num_workers=1, **FORK))
    dl = DataLoader(Stream(30), batch_size=4, num_workers=1, **FORK)
    first, state, it = stop_after(dl, 3)
    del it
    fresh = DataLoader(Stream(30), batch_size=4, num_workers=1, multiprocessing_context="spawn")
    with pytest.warns(UserWarning, match="fast-forwarding 12 samples"):
        fresh.load_state_dict(state)
    assert stream_values(first) + stream_values(fresh) == reference


def test_iterable_resume_in_main_process():
    reference = stream_values(DataLoader(StatefulStream(20), batch_size=3))
    dl = DataLoader(StatefulStream(20), batch_size=3)
    first, state, _it = stop_after(dl, 2)
    fresh = DataLoader(StatefulStream(20), batch_size=3)
    fresh.load_state_dict(state)
    assert stream_values(first) + stream_values(fresh) == reference


def test_public_names():
    for name in ("sample_rng", "get_shard_info", "ShardInfo"):
        assert name in shmloader.__all__
