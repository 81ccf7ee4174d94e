"""Variable-size samples, a ring that grows, and batches the consumer keeps (issue 5)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from shmloader import BatchLayoutError, BucketBatchSampler, Padded, RingLimitError

from . import datasets as D
from .datasets import NumpyLoader as DataLoader  # numpy output: these tests check numpy views


def test_images_of_random_sizes_as_lists_of_views(method):
    dl = DataLoader(
        D.RandomSizeImages(), batch_size=8, num_workers=2, multiprocessing_context=method, collate="list"
    )
    batches = list(dl)
    for b, batch in enumerate(batches):
        assert batch["label"].tolist() == list(range(8 * b, 8 * b + 8))
        for i, image in zip(batch["label"].tolist(), batch["image"]):
            assert np.array_equal(image, D.image_of(i))
            if b >= 2:  # past each worker's first batch, which sizes the ring
                assert not image.flags.owndata and dl.ring.contains(image)


def test_images_of_random_sizes_padded(method):
    dl = DataLoader(
        D.RandomSizeImages(),
        batch_size=8,
        num_workers=2,
        multiprocessing_context=method,
        collate="pad",
        pad_value=7,
    )
    for batch in dl:
        padded = batch["image"]
        assert isinstance(padded, Padded) and padded.lengths.shape == (8, 3)
        for row, (i, (h, w, _)) in enumerate(zip(batch["label"].tolist(), padded.lengths.tolist())):
            image = D.image_of(i)
            assert (h, w) == image.shape[:2]
            assert np.array_equal(padded.values[row, :h, :w], image)
            assert (padded.values[row, h:] == 7).all() and (padded.values[row, :, w:] == 7).all()
    assert np.array_equal(
        list(DataLoader(D.RandomSizeImages(), batch_size=8, collate="pad"))[1]["image"].lengths,
        np.array([D.image_of(i).shape for i in range(8, 16)]),
    ), "the main process pads the same way"


def test_first_batch_goes_out_before_the_ring_is_made(method):
    # With one worker, no other task is in flight when the first result (which sizes the
    # ring) arrives: the ring, which takes tens of ms to reserve, is still made only at the
    # next call, after that batch is handed out.
    dl = DataLoader(D.Squares(), batch_size=4, num_workers=1, multiprocessing_context=method)
    it = iter(dl)
    first = next(it)
    assert first[1].tolist() == [0, 1, 2, 3] and dl.ring is None
    second = next(it)
    assert second[1].tolist() == [4, 5, 6, 7] and dl.ring.contains(second[0])
    assert [b[1].tolist()[0] for b in it] == list(range(8, 100, 4))


def test_stack_refuses_ragged_samples_with_a_clear_error():
    with pytest.raises(BatchLayoutError, match="field \\['image'\\] differs between samples"):
        next(iter(DataLoader(D.RandomSizeImages(), batch_size=8)))
    with pytest.raises(ValueError, match="collate should be one of"):
        DataLoader(D.RandomSizeImages(), collate="ragged")


def test_bucketed_token_sequences_padded(method):
    ds = D.Tokens()
    lengths = ds.lengths()
    sampler = BucketBatchSampler(lengths, batch_size=8, num_buckets=10, seed=3)
    dl = DataLoader(ds, batch_sampler=sampler, num_workers=2, multiprocessing_context=method, collate="pad")
    seen, waste, total = [], 0, 0
    for batch, indices in zip(dl, BucketBatchSampler(lengths, batch_size=8, num_buckets=10, seed=3)):
        assert batch.lengths.tolist() == [lengths[i] for i in indices]
        for row, i in enumerate(indices):
            assert np.array_equal(batch.values[row, : lengths[i]], D.tokens_of(i))
        seen.extend(indices)
        waste += batch.values.size - batch.lengths.sum()
        total += batch.values.size
    assert sorted(seen) == list(range(200))
    assert waste / total < 0.15, f"bucketing keeps padding low ({waste / total:.1%})"


def test_bucket_sampler_is_deterministic_per_seed_and_epoch():
    lengths = np.random.default_rng(0).integers(1, 500, 300)
    a = BucketBatchSampler(lengths, 16, bucket_width=50, seed=1)
    b = BucketBatchSampler(lengths, 16, bucket_width=50, seed=1)
    e0, e1 = list(a), list(a)
    assert e0 == list(b) and e1 == list(b) and e0 != e1
    b.set_epoch(0)
    assert list(b) == e0
    for batch in e0:
        assert max(lengths[batch]) // 50 == min(lengths[batch]) // 50, "one bucket per batch"
    assert sorted(i for batch in e0 for i in batch) == list(range(300))
    assert len(a) == len(e0)
    dropped = BucketBatchSampler(lengths, 16, bucket_width=50, drop_last=True)
    assert all(len(x) == 16 for x in dropped) and len(list(dropped)) == len(dropped)


def test_batches_that_grow_tenfold_are_delivered(method):
    sizes = [2, 2, 2, 2, 20, 20, 20, 20, 20, 2]
    batches, start = [], 0
    for n in sizes:
        batches.append(list(range(start, start + n)))
        start += n
    dl = DataLoader(D.Squares(200), batch_sampler=batches, num_workers=2, multiprocessing_context=method)
    out = list(dl)
    assert [b[1].tolist() for b in out] == batches
    assert all((x[:, 0, 0] == y).all() for x, y in out)
    assert dl.ring.slot_bytes >= 20 * (64 + 8), "the ring grew to the larger batches"
    assert not out[-2][0].flags.owndata and dl.ring.contains(out[-2][0])


def test_fixed_slot_bytes_turns_growth_off(method):
    dl = DataLoader(
        D.Squares(40),
        batch_sampler=[[0], [1, 2, 3, 4, 5, 6, 7, 8]],
        num_workers=2,
        multiprocessing_context=method,
        slot_bytes=512,  # one sample and its layout fit, eight samples (576 bytes of data) do not
    )
    it = iter(dl)
    assert next(it)[1].tolist() == [0]
    with pytest.raises(
        BatchLayoutError, match=r"needs \d+ bytes but slots hold 512 \(slot_bytes was fixed\)"
    ):
        next(it)


@pytest.mark.slow
def test_keeping_5000_batches_grows_then_hits_the_limit(method):
    fds_before = len(os.listdir("/proc/self/fd"))
    limit = 24 * 2**20
    dl = DataLoader(
        D.Wide(), batch_size=2, num_workers=2, multiprocessing_context=method, max_shm_bytes=limit
    )
    kept = []
    with pytest.raises(RingLimitError) as info:
        for batch in dl:
            kept.append(batch)
    text = str(info.value)
    assert "max_shm_bytes=25165824" in text and text.startswith("The consumer holds") and "copy=True" in text
    assert 1000 < len(kept) < 5000
    assert all(int(b[0, 0]) == 2 * n for n, b in enumerate(kept))
    assert dl.pinned_shm_bytes() <= limit
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1, "one ring descriptor, however many rings"
    del kept, batch, info
    gc.collect()
    # With copy=True the same consumer keeps all 5,000 batches in process memory.
    kept = list(zip(range(5000), dl.iter(copy=True)))
    assert len(kept) == 5000 and all(b.flags.owndata or b.base is not None for _, b in kept)
    assert all(int(b[1, 0]) == 2 * n + 1 for n, b in kept)


def test_copy_true_keeps_data_after_the_ring_is_gone(method):
    dl = DataLoader(D.Squares(40), batch_size=4, num_workers=2, multiprocessing_context=method, copy=True)
    kept = list(dl)
    assert not any(dl.ring.contains(x) for x, _ in kept)
    del dl
    gc.collect()
    maps = [line for line in open("/proc/self/maps") if "shmloader-" in line]
    assert not maps, "the ring is unmapped: no batch refers to it"
    assert [int(v) for _, y in kept for v in y] == list(range(40))
    assert all((x[:, 0, 0] == y).all() for x, y in kept)


def test_stats_count_batches_copies_and_growth(method):
    dl = DataLoader(D.Squares(300), batch_size=3, num_workers=2, multiprocessing_context=method)
    kept = list(dl)  # every batch kept: the ring grows
    stats = dl.stats()
    assert stats["batches"] == len(kept) == 100
    assert stats["batches_copied"] == 2, "only each worker's first batch, which sizes the ring"
    assert stats["rings_created"] >= 4 and stats["num_slots"] >= 64
    assert stats["pinned_shm_bytes"] == dl.pinned_shm_bytes() > 0
    assert stats["dataset"] == {}
    main = DataLoader(D.Squares(30), batch_size=3)
    list(main)
    assert main.stats()["batches"] == main.stats()["batches_copied"] == 10


def test_stats_sum_the_datasets_own_counters_over_workers(method):
    dl = DataLoader(D.Counted(), batch_size=5, num_workers=2, multiprocessing_context=method)
    for _ in range(2):
        assert len(list(dl)) == 10
    assert dl.stats()["dataset"] == {"odd_ones": 2 * 8}  # 0, 7, ..., 49: 8 per epoch
    main = DataLoader(D.Counted(), batch_size=5)
    list(main)
    assert main.stats()["dataset"] == {"odd_ones": 8}


@pytest.mark.parametrize("collate", ["pad", "list"])
def test_ragged_batches_share_one_decoded_skeleton(collate):
    """Batches whose shapes all differ have one structure: the consumer decodes it once
    (only the offsets and shapes travel per batch), and every batch is still right."""
    dataset = D.Tokens()
    dl = DataLoader(dataset, batch_size=4, num_workers=1, collate=collate, multiprocessing_context="fork")
    it = iter(dl)
    n = 0
    for batch in it:
        idx = range(4 * n, 4 * n + 4)  # 200 samples: 50 full batches
        want = [dataset[i] for i in idx]
        if collate == "pad":
            assert batch.lengths.tolist() == [len(w) for w in want]
            for row, w in zip(batch.values, want):
                assert (row[: len(w)] == w).all() and (row[len(w) :] == 0).all()
        else:
            assert [v.tolist() for v in batch] == [w.tolist() for w in want]
        n += 1
    assert n == 50 and len(it.readers) == 1


def _growing_batches() -> list[list[int]]:
    sizes = [2, 2, 2, 2, 20, 20, 20, 20, 20, 2]
    return [list(range(sum(sizes[:k]), sum(sizes[: k + 1]))) for k in range(len(sizes))]


def test_batches_outside_the_ring_come_in_their_own_segments(method):
    """Each worker's first batch (which sizes the ring) and a batch that outgrew its slot,
    when bigger than PICKLED_MAX_BYTES, are views of a one-off segment the worker made and
    passed by descriptor: mapped here, not copied, and unmapped with their last view; no
    descriptor stays open for them."""
    batches = _growing_batches()
    # 64 KiB samples: a first batch of 2 is past PICKLED_MAX_BYTES; one of 20 outgrows its slot.
    dataset = D.Squares(200, side=128)
    dl = DataLoader(dataset, batch_sampler=batches, num_workers=2, multiprocessing_context=method)
    it = iter(dl)
    it.start()  # the workers and their sockets exist (iter() alone starts nothing)
    fds_before = len(os.listdir("/proc/self/fd"))
    first = next(it)
    assert _in_shared_memory(first[0]), "a view of its segment, not a copy"
    assert len(os.listdir("/proc/self/fd")) == fds_before  # mapped; its descriptor is closed
    out = [first, *it]
    assert [b[1].tolist() for b in out] == batches
    assert all((x[:, 0, 0] == y).all() for x, y in out)
    grown = out[4][0]  # the first batch of 20: it outgrew the ring's slots
    assert _in_shared_memory(grown) and not dl.ring.contains(grown)
    assert dl.stats()["batches_copied"] >= 3  # the two first batches and the grown one
    del it, first, out, grown, dl
    gc.collect()
    assert not [line for line in open("/proc/self/maps") if "shmloader-" in line]


def test_batches_come_pickled_when_no_segment_can_be_made(monkeypatch):
    """A worker that cannot make a one-off segment (e.g. /dev/shm is full) sends the batch
    pickled instead: the same values (fork: the workers inherit the patch)."""
    from shmloader import ShmSpaceError
    from shmloader.memory.ring import Ring

    real_create = Ring.create.__func__

    def no_one_off_segments(cls, num_slots, slot_bytes, **kw):
        if num_slots == 1:
            raise ShmSpaceError("no room for a one-off segment (test)")
        return real_create(cls, num_slots, slot_bytes, **kw)

    monkeypatch.setattr(Ring, "create", classmethod(no_one_off_segments))
    batches = _growing_batches()
    dataset = D.Squares(200, side=128)  # past PICKLED_MAX_BYTES: these would go in segments
    dl = DataLoader(dataset, batch_sampler=batches, num_workers=2, multiprocessing_context="fork")
    out = list(dl)
    assert [b[1].tolist() for b in out] == batches
    assert all((x[:, 0, 0] == y).all() for x, y in out)
    assert not _in_shared_memory(out[0][0]) and not _in_shared_memory(out[4][0]), "unpickled"
    assert _in_shared_memory(out[-1][0]), "batches in the ring as usual"
    assert dl.stats()["batches_copied"] >= 3


def test_small_batches_outside_the_ring_come_pickled(method):
    """A batch outside the ring of at most PICKLED_MAX_BYTES (a small first batch, which
    sizes the ring) comes pickled in its frame, not in a one-off segment: the same values,
    in process memory; a bigger one that outgrew its slot still comes in a segment."""
    from shmloader.workers.worker import PICKLED_MAX_BYTES

    batches = _growing_batches()
    dataset = D.Squares(200, side=32)  # 4 KiB samples: batches of 2 are small, of 20 are not
    assert 2 * 4096 < PICKLED_MAX_BYTES < 20 * 4096
    dl = DataLoader(dataset, batch_sampler=batches, num_workers=2, multiprocessing_context=method)
    out = list(dl)
    assert [b[1].tolist() for b in out] == batches
    assert all((x[:, 0, 0] == y).all() for x, y in out)
    assert not _in_shared_memory(out[0][0]) and not _in_shared_memory(out[1][0]), "pickled"
    assert _in_shared_memory(out[4][0]) and not dl.ring.contains(out[4][0]), "in its own segment"
    assert dl.ring.contains(out[-1][0])
    assert dl.stats()["batches_copied"] >= 3


def _in_shared_memory(array: np.ndarray) -> bool:
    """True when ``array``'s memory lies in a shmloader segment mapped by this process."""
    address = array.__array_interface__["data"][0]
    for line in open("/proc/self/maps"):
        if "shmloader-" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False
