"""The write-into protocol: samples produced straight into the slot's rows."""

from __future__ import annotations

import numpy as np
import pytest

from shmloader import ArraySpec, BatchLayoutError
from shmloader.memory.ring import populate_supported

from . import datasets as D
from .conftest import START_METHODS
from .datasets import NumpyLoader as DataLoader  # numpy output: these tests check numpy views


@pytest.mark.parametrize("method", START_METHODS)
def test_write_into_gives_the_same_batches_as_getitem(method):
    ds = D.WriteInto()
    dl = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=method)
    got = list(zip(range(3), dl))  # keep three batches alive
    reference = [D.WriteInto.__getitem__(ds, i) for i in range(12)]
    for n, batch in got:
        assert batch["image"].shape == (4, 4, 5, 3) and batch["image"].dtype == np.uint8
        assert batch["label"].tolist() == list(range(4 * n, 4 * n + 4))
        for row in range(4):
            assert np.array_equal(batch["image"][row], reference[4 * n + row]["image"])
    assert dl.ring.contains(got[-1][1]["image"])


def test_write_into_in_the_main_process():
    batches = list(DataLoader(D.WriteInto(10), batch_size=4))
    assert [b["label"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (batches[2]["image"][1] == 9).all()


def test_a_user_collate_fn_turns_the_protocol_off():
    dl = DataLoader(D.WriteInto(4), batch_size=2, collate_fn=lambda s: [x["label"] for x in s])
    assert [list(map(int, b)) for b in dl] == [[0, 1], [2, 3]]


def test_a_bad_spec_is_a_clear_error():
    class Bad(D.WriteInto):
        def sample_spec(self):
            return {"image": (4, 5, 3)}

    with pytest.raises(
        BatchLayoutError, match=r"returned int at \['image'\]\[0\]; every leaf must be a shmloader.ArraySpec"
    ):
        list(DataLoader(Bad(), batch_size=2))
    assert ArraySpec([2, 3], "f4") == ArraySpec((2, 3), np.float32)


class _SamplesOnly:
    """The same samples as D.WriteInto, through __getitem__ only (no write-into protocol)."""

    def __init__(self, n: int):
        self.inner = D.WriteInto(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return self.inner[i]


@pytest.mark.skipif(not populate_supported(), reason="sparse rings (MADV_POPULATE_WRITE, Linux 5.14+)")
def test_the_first_batches_go_straight_into_a_ring_sized_from_the_spec():
    """A write-into dataset declares its batch's bytes: the ring is made before the
    workers start, sized as a first batch would size it, and their first batches land
    in it (no one-off segment each, as a dataset of plain samples still takes)."""
    stats = {}
    for name, ds in (("write-into", D.WriteInto(24)), ("samples", _SamplesOnly(24))):
        dl = DataLoader(ds, batch_size=4, num_workers=2)
        labels = [b["label"].tolist() for b in dl]
        assert labels == [list(range(i, i + 4)) for i in range(0, 24, 4)]
        stats[name] = dl.stats()
    assert stats["write-into"]["batches_copied"] == 0 and stats["samples"]["batches_copied"] == 2
    assert stats["write-into"]["rings_created"] == stats["samples"]["rings_created"] == 1
    assert stats["write-into"]["slot_bytes"] == stats["samples"]["slot_bytes"]
