"""Small leaves kept by the loop, and a ring that shrinks back (issue 27, item 13).

Keeping the labels of many batches (``labels.append(batch["label"])``, ``batch[1]``, a
slice of them) keeps only the labels, as with torch's loader (whose tensors own one
segment each): in a big batch, an array much smaller than the largest one is a copy that
owns its memory. And a ring that grew because the loop kept whole batches goes back to
its first size once they are gone: at the next epoch's start, or mid-epoch.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from shmloader import DataLoader
from shmloader.batch import layout
from shmloader.memory import sizing
from shmloader.memory.ring import Ring, ring_bytes
from shmloader.system import slots as _slots

from . import datasets as D

FORK = {"multiprocessing_context": "fork"}
SIDE = 64  # 3 x 64 x 64 uint8 images: 12 KiB a sample, 384 KiB a batch of 32
BATCH = 32
KEPT = 400  # batches whose labels the loop keeps


class Labelled:
    """Sample i: a 3 x SIDE x SIDE uint8 image filled with i % 251 and the label i, as a
    dict (``as_dict``) or a tuple."""

    def __init__(self, n: int, as_dict: bool = True) -> None:
        self.n = n
        self.as_dict = as_dict

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = np.full((3, SIDE, SIDE), i % 251, np.uint8)
        return {"image": image, "label": i} if self.as_dict else (image, i)


def label_of(batch, as_dict: bool):
    return batch["label"] if as_dict else batch[1]


def image_of(batch, as_dict: bool):
    return batch["image"] if as_dict else batch[0]


def owned_bytes(leaf) -> int:
    """The bytes of the memory that keeping ``leaf`` keeps alive (its buffer's owner)."""
    if not isinstance(leaf, np.ndarray):
        return leaf.untyped_storage().nbytes()  # a torch tensor: its storage
    while isinstance(leaf.base, np.ndarray):
        leaf = leaf.base
    return leaf.nbytes


def steady_ring_bytes(dl) -> int:
    return ring_bytes(dl.stats()["num_slots"], dl.stats()["slot_bytes"])


@pytest.mark.parametrize("as_dict", [True, False], ids=["dict", "tuple"])
@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_kept_labels_do_not_pin_their_images(method, output, as_dict):
    """The issue's loop: keep the labels of 400 batches of images (and a slice of each).
    The ring keeps its size (no slot stays held for a label) and the labels are torch's."""
    torch = pytest.importorskip("torch") if output == "torch" else None
    dataset = Labelled(KEPT * BATCH, as_dict)
    dl = DataLoader(dataset, batch_size=BATCH, num_workers=2, output=output, multiprocessing_context=method)
    labels, firsts = [], []
    for batch in dl:
        label = label_of(batch, as_dict)
        labels.append(label)
        firsts.append(label[:1])
        assert owned_bytes(label) == BATCH * 8, "the label owns its memory, apart from the images"
    del batch, label
    stats = dl.stats()
    steady = sizing.default_num_slots(2)
    assert stats["num_slots"] == steady and stats["rings_created"] == 1, stats
    assert dl.pinned_shm_bytes() == steady_ring_bytes(dl), "only the steady ring is mapped"
    assert not any(dl.ring.states.load(i) == _slots.HELD for i in range(steady)), "no slot held"
    if torch is not None:
        want = [label_of(b, as_dict) for b in torch.utils.data.DataLoader(dataset, batch_size=BATCH)]
        assert all(isinstance(x, torch.Tensor) and x.dtype == torch.int64 for x in labels)
        assert all(torch.equal(x, y) for x, y in zip(labels, want)) and len(labels) == len(want)
    else:
        assert [x.tolist() for x in labels] == [
            list(range(k, k + BATCH)) for k in range(0, KEPT * BATCH, BATCH)
        ]
    assert [int(x[0]) for x in firsts] == list(range(0, KEPT * BATCH, BATCH))


def test_images_stay_views_and_small_batches_stay_whole():
    """What stays zero-copy: the big leaf of a big batch (a view of its slot), and every
    leaf of a batch below layout.APART_MIN_BYTES (a W3-shaped record batch)."""
    dl = DataLoader(Labelled(40 * BATCH), batch_size=BATCH, num_workers=2, output="numpy", **FORK)
    batches = list(dl)
    late = batches[-1]
    assert dl.ring.contains(late["image"]) and not late["image"].flags.owndata
    assert late["label"].flags.owndata and not dl.ring.contains(late["label"])
    assert dl.stats()["batches_copied"] == 2, "a batch with its labels apart is not a copied batch"
    del batches, late

    records = DataLoader(D.Squares(400, side=8), batch_size=16, num_workers=2, output="numpy", **FORK)
    x, y = list(records)[-1]
    assert x.nbytes + y.nbytes < layout.APART_MIN_BYTES
    assert records.ring.contains(x) and records.ring.contains(y), "a small batch: views of its slot"


@pytest.mark.parametrize("copy", [False, True], ids=["views", "copy"])
def test_main_process_and_copy_batches_keep_labels_apart(copy):
    """num_workers=0 builds a batch in one buffer, copy=True copies the slot in one: a
    kept label is still only a label (torch's tensors each own their memory)."""
    dataset = Labelled(20 * BATCH)
    for workers in (0, 2):
        where = FORK if workers else {}
        dl = DataLoader(dataset, batch_size=BATCH, num_workers=workers, output="numpy", copy=copy, **where)
        labels = [b["label"] for b in dl]
        assert all(owned_bytes(x) == BATCH * 8 for x in labels), workers
        assert [int(x[0]) for x in labels] == list(range(0, 20 * BATCH, BATCH))


class Tokens:
    """Sample i: 4000 + (37 i mod 500) int32 tokens equal to i (a batch of 16 pads to about
    280 KiB), its id, and two int16 equal to i."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        return {"tokens": np.full(length(i), i, np.int32), "id": i, "tiny": np.full(2, i, np.int16)}


def length(i: int) -> int:
    return 4000 + 37 * i % 500


@pytest.mark.parametrize("collate", ["pad", "list"])
def test_ragged_batches_keep_small_leaves_apart(collate):
    """Padded and listed fields: a padded field's lengths, the ids and the tiny field
    are their own; the token arrays, of similar sizes, stay views of the slot."""
    dl = DataLoader(Tokens(), batch_size=16, num_workers=2, collate=collate, output="numpy", **FORK)
    for b, batch in enumerate(dl):
        ids = list(range(16 * b, 16 * b + 16))
        assert batch["id"].tolist() == ids
        tokens, tiny = batch["tokens"], batch["tiny"]
        if collate == "pad":
            assert tokens.lengths.tolist() == [length(i) for i in ids]
            assert all((row[: length(i)] == i).all() for row, i in zip(tokens.values, ids))
            tiny = tiny.values
        else:
            assert [(len(t), int(t[0])) for t in tokens] == [(length(i), i) for i in ids]
        assert [t.tolist() for t in tiny] == [[i, i] for i in ids]
        if b >= 2:  # from the ring (the first two sized it)
            big = tokens.values if collate == "pad" else tokens[0]
            assert dl.ring.contains(big)
            assert owned_bytes(batch["id"]) == 16 * 8
            assert all(owned_bytes(t) <= 16 * 2 * 2 for t in tiny)
            if collate == "pad":
                assert owned_bytes(tokens.lengths) == 16 * 8
    assert b == 15


class RecordingHost:
    """Stands in for pinning.CudaHost without a GPU: records the page-locked copies."""

    def __init__(self) -> None:
        self.copies = 0

    def register(self, address: int, size: int) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass

    def pinned_copy(self, tensor):
        self.copies += 1
        return tensor.clone()

    def record(self):
        return None

    def done(self, event) -> bool:
        return True

    def wait(self, event) -> None:
        pass


def test_pinned_small_leaves_are_page_locked_copies(monkeypatch):
    """pin_memory=True: a label handed out apart is copied into page-locked memory (torch's
    loader pins every tensor); the images stay views of the page-locked ring."""
    pytest.importorskip("torch")
    from shmloader.batch import pinning

    host = RecordingHost()
    monkeypatch.setattr(
        pinning, "make_pinner", lambda pin, stacklevel=3: pinning.RingPinner(host) if pin else None
    )
    # (slot_bytes: every batch in the ring, none pinned by copy as a segment's would be)
    dl = DataLoader(
        Labelled(20 * BATCH),
        batch_size=BATCH,
        num_workers=2,
        output="torch",
        pin_memory=True,
        slot_bytes=2**19,
        **FORK,
    )
    labels = []
    for batch in dl:
        labels.append(batch["label"])
        image = batch["image"]
    assert dl.ring.contains(image.numpy()), "the images: views of the ring"
    del batch, image
    assert host.copies == 20, "each label, copied into page-locked memory"
    assert [int(x[0]) for x in labels] == list(range(0, 20 * BATCH, BATCH))


# --- a grown ring goes back to its size -------------------------------------------------------


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_ring_grown_for_kept_batches_returns_to_its_size_next_epoch(method, persistent):
    """A loop keeps every batch of an epoch (the ring grows), then drops them: the next
    epoch's batches go to a ring of the first one's size, the grown one is unmapped, and
    the batches are torch's."""
    dataset = Labelled(60 * BATCH)
    dl = DataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=2,
        output="numpy",
        persistent_workers=persistent,
        multiprocessing_context=method,
    )
    kept = list(dl)
    grown = dl.stats()
    steady = sizing.default_num_slots(2)
    assert grown["num_slots"] > steady, "the ring grew for the kept batches"
    first_ring = grown["slot_bytes"]
    del kept
    gc.collect()
    labels = []
    for batch in dl:
        labels.append(int(batch["label"][0]))
        assert (batch["image"][:, 0, 0, 0] == np.arange(labels[-1], labels[-1] + BATCH) % 251).all()
    del batch
    stats = dl.stats()
    assert stats["num_slots"] == steady and stats["slot_bytes"] == first_ring, stats
    assert dl.pinned_shm_bytes() == steady_ring_bytes(dl), "the grown ring is unmapped"
    assert labels == list(range(0, 60 * BATCH, BATCH))
    dl.shutdown()


def test_a_ring_grown_mid_epoch_returns_to_its_size_mid_epoch():
    """One long epoch (an iterable stream's): the loop keeps 100 batches, then drops them
    and goes on: a few batches later the ring is back to its first size."""
    dl = DataLoader(Labelled(400 * BATCH), batch_size=BATCH, num_workers=2, output="numpy", **FORK)
    steady = sizing.default_num_slots(2)
    it = iter(dl)
    kept = [next(it) for _ in range(100)]
    assert dl.stats()["num_slots"] > steady
    del kept
    gc.collect()
    seen = [int(next(it)["label"][0]) for _ in range(2 * steady)]
    assert dl.stats()["num_slots"] == steady
    seen += [int(b["label"][0]) for b in it]
    assert seen == list(range(100 * BATCH, 400 * BATCH, BATCH))
    assert dl.pinned_shm_bytes() == steady_ring_bytes(dl)


def test_bursts_of_kept_batches_do_not_remake_rings():
    """A loop that keeps batches in bursts (gradient accumulation: 6 batches, then drop)
    needs a grown ring all along: shrinks it undoes at once are tried ever more rarely
    (about two rings per doubling of the wait), not every few batches (300 rings)."""
    n = 3000
    dl = DataLoader(
        np.arange(n * 4, dtype=np.int64).reshape(n, 4), batch_size=1, num_workers=2, output="numpy", **FORK
    )
    held = []
    total = 0
    for batch in dl:
        held.append(batch)
        if len(held) == 6:
            total += sum(int(b[0, 0]) for b in held)
            held.clear()
    assert total == sum(range(0, n * 4, 4))
    assert dl.stats()["rings_created"] <= 24, dl.stats()["rings_created"]


def test_a_retired_ring_gives_back_its_free_slots_memory():
    """Ring.release_free_slots: the pages of FREE slots go back (the segment's allocated
    blocks shrink), those of slots in use keep their bytes."""
    ring = Ring.create(8, 256 * 1024, populate=True)
    try:
        for i in range(8):
            ring.slot_array(i)[:] = i + 1
        for i in (2, 3, 6):
            ring.states.store(i, _slots.HELD)
        before = os.fstat(ring.fd).st_blocks * 512
        released = ring.release_free_slots()
        after = os.fstat(ring.fd).st_blocks * 512
        assert released >= 5 * 256 * 1024 - 2 * 4096 and before - after >= released - 4096
        for i in (2, 3, 6):
            assert (ring.slot_array(i) == i + 1).all(), "a slot in use keeps its bytes"
    finally:
        ring.close_fd()
