"""The benchmark's consumer (shmloader.bench.consume): it reads every page of every leaf
of a batch, and only the pages the leaves lie on.

Which pages were read is what the kernel says: the arrays live in a fresh memfd mapping
(no page present until touched; a read allocates it), and ``mincore`` lists the pages
present afterwards.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import sys

import numpy as np
import pytest

from shmloader.batch.collate import Padded
from shmloader.bench.consume import PAGE, read_every_page

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"), reason="memfd and mincore: Linux"
)

PAGES = 64


class _Fresh:
    """``PAGES`` pages of a memfd, mapped shared, none of them touched yet."""

    def __init__(self, pages: int = PAGES):
        self.fd = os.memfd_create("test-consume")
        os.ftruncate(self.fd, pages * PAGE)
        self.map = mmap.mmap(self.fd, pages * PAGE)
        self.bytes = np.frombuffer(self.map, np.uint8)
        self.pages = pages

    def present(self) -> list[int]:
        """The indices of the pages the kernel holds (mincore)."""
        libc = ctypes.CDLL(None, use_errno=True)
        vec = (ctypes.c_ubyte * self.pages)()
        addr = ctypes.c_void_p(self.bytes.ctypes.data)
        if libc.mincore(addr, ctypes.c_size_t(self.pages * PAGE), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return [i for i in range(self.pages) if vec[i] & 1]

    def close(self) -> None:
        del self.bytes
        self.map.close()
        os.close(self.fd)


@pytest.fixture
def fresh():
    f = _Fresh()
    yield f
    f.close()


def _pages_of(byte_ranges: list[tuple[int, int]]) -> list[int]:
    """The pages the half-open byte ranges lie on."""
    return sorted({p for lo, hi in byte_ranges for p in range(lo // PAGE, (hi - 1) // PAGE + 1)})


def test_a_contiguous_array_is_read_on_every_page_and_no_other(fresh):
    start, stop = 100, 40 * PAGE + 7  # neither end on a page boundary
    a = fresh.bytes[start:stop].view(np.uint8)
    assert fresh.present() == []
    read_every_page(a)
    assert fresh.present() == _pages_of([(start, stop)])


def test_a_float_array_with_a_last_partial_page(fresh):
    a = fresh.bytes[: 10 * PAGE + 8].view(np.float64)
    read_every_page(a)
    assert fresh.present() == list(range(11))


def test_strided_rows_read_only_the_rows_pages(fresh):
    rows = fresh.bytes.reshape(PAGES // 2, 2 * PAGE)  # rows of two pages
    every_other = rows[::2, : PAGE + 100]  # a page and a bit of every other row
    read_every_page(every_other)
    row_bytes = [(r * 2 * PAGE, r * 2 * PAGE + PAGE + 100) for r in range(0, PAGES // 2, 2)]
    assert fresh.present() == _pages_of(row_bytes)


def test_an_image_batch_cropped_in_its_width(fresh):
    images = fresh.bytes[: 8 * 64 * 64 * 3 * 2].reshape(8, 64, 128, 3)  # 8 images, 128 x 64 HWC
    left = images[:, :, :20]  # 60-byte runs a row, rows 384 bytes apart
    read_every_page(left)
    runs = [(b, b + 60) for b in range(0, images.nbytes, 128 * 3)]
    assert fresh.present() == _pages_of(runs)


def test_an_element_strided_axis_reads_the_pages_of_its_elements(fresh):
    floats = fresh.bytes.view(np.float32)
    column = floats[:: 3 * PAGE // 4 + 1]  # one float every 3 pages and 4 bytes
    read_every_page(column)
    assert fresh.present() == _pages_of(
        [(i * column.strides[0], i * column.strides[0] + 4) for i in range(column.size)]
    )


def test_trees_of_leaves_padded_dicts_lists_tuples(fresh):
    a = fresh.bytes[: 8 * PAGE]
    b = fresh.bytes[20 * PAGE : 30 * PAGE].view(np.int32).reshape(10, -1)
    c = fresh.bytes[40 * PAGE : 41 * PAGE + 1]
    batch = {"image": [a], "tokens": Padded(values=b, lengths=np.arange(10)), "extra": ("a", 3, None, c)}
    read_every_page(batch)
    assert fresh.present() == [*range(8), *range(20, 30), 40, 41]


def test_torch_tensors_are_read_in_place(fresh):
    torch = pytest.importorskip("torch")
    base = torch.from_numpy(fresh.bytes)
    images = base[: 16 * PAGE].view(torch.float32).reshape(4, -1)
    half = base[32 * PAGE : 40 * PAGE].view(torch.bfloat16)  # numpy has no bfloat16
    read_every_page((images, {"h": half}))
    assert fresh.present() == [*range(16), *range(32, 40)]


def test_what_it_returns_depends_on_what_it_read():
    zeros = np.zeros(10 * PAGE, np.uint8)
    ones = np.ones(10 * PAGE, np.uint8)
    assert read_every_page(zeros) == 0
    assert read_every_page(ones) == 11  # a byte per page and the last byte
    assert read_every_page([ones, "abc", 7, 2.5, None]) == 11 + 3 + 1 + 1
    assert read_every_page(np.empty((0, 3))) == 0
    assert read_every_page(np.float32(1.0)) == 1
    assert read_every_page(np.ones((), np.int64)) == 1
    assert read_every_page(b"\x01" * (2 * PAGE)) == 3
    assert read_every_page(np.array([None, "a", 3], dtype=object)) == 3


def test_the_reader_keeps_no_reference_to_what_it_read():
    """A batch's slot is released when its last view goes: a reader that kept one until
    the next GC pass (a reference cycle) would hold the ring's slots."""
    batch = (np.ones(3 * PAGE, np.uint8), {"y": [np.arange(4)]})
    before = [sys.getrefcount(leaf) for leaf in (batch[0], batch[1]["y"][0])]
    gc.disable()
    try:
        read_every_page(batch)
        after = [sys.getrefcount(leaf) for leaf in (batch[0], batch[1]["y"][0])]
    finally:
        gc.enable()
    assert after == before


def test_a_tensor_not_in_host_memory_is_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="host memory"):
        read_every_page(torch.empty(4, device="meta"))


class _Batches:
    """A loader whose batches are fresh memfd pages: ``(images, labels)``, batch ``i``
    on pages ``[8 i, 8 i + 8)`` (7 pages of images, one of labels)."""

    persistent_workers = False

    def __init__(self, fresh: _Fresh, batches: int):
        self.fresh = fresh
        self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for i in range(self.batches):
            block = self.fresh.bytes[i * 8 * PAGE : (i + 1) * 8 * PAGE]
            yield block[: 7 * PAGE].reshape(4, -1), block[7 * PAGE :].view(np.int64)[:4]


def test_every_bench_consumer_reads_what_it_is_given(fresh):
    """The loops that time loaders (W1-W5, W7's peers; W6's epochs and fresh passes) read
    every page of every batch they are handed."""
    from shmloader.bench import jpeg, peers

    peers.time_loader(_Batches(fresh, 2), batches=10, max_s=60, from_first=True)
    assert fresh.present() == list(range(16))
    jpeg._epoch(_Batches(fresh, 4))
    assert fresh.present() == list(range(32))
    images, batches, *_ = jpeg._fresh_pass(lambda: _Batches(fresh, 6))
    assert (images, batches) == (24, 6) and fresh.present() == list(range(48))
