"""Live iterators of one loader, against torch (issue 27, item 11).

torch allows several live iterators of one loader (``zip(dl, dl)``, a loop nested in a
loop over the same loader): without persistent workers each is an epoch of its own;
with them the loader has one iterator and ``iter()`` resets it (the second ``iter()`` of
``zip(dl, dl)`` starts the epoch again, and both names step the same iterator). The
oracle is torch's loader on the same dataset and access pattern: the sample indices of
every batch each iterator yields, in order. The batches grow (the ring is remade for
larger slots, by one iterator while the other still uses the old ring) and are held to
the end, so a rewritten slot shows as wrong indices. Before, one iterator retired the
ring the other had just made, and sending it to its workers raised a TypeError.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from shmloader.memory import ring as ring_mod  # noqa: E402

from . import datasets as D  # noqa: E402
from .datasets import NumpyLoader as DataLoader  # noqa: E402


def Rows() -> D.Squares:
    """Sample i: 32 KiB of float32 filled with i, and i (a batch of 20 passes the size
    above which a ring is made on a thread, where rings are reserved whole)."""
    return D.Squares(1000, side=90)


def batches_of(sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


GROWING = batches_of([2, 2, 2, 2, 20, 20, 20, 20, 2, 40, 40, 3, 30])


def indices(batch) -> list[int]:
    """The sample indices of a batch (torch's or ours), checked against its data."""
    x, y = batch
    y = np.asarray(y)
    assert (np.asarray(x)[:, 0, 0] == y).all(), "the data is not the samples' own"
    return y.tolist()


def patterns(make) -> dict:
    """What each access pattern yields, from loaders made by ``make()``."""
    out = {}
    dl = make()
    pairs = list(zip(dl, dl))
    out["zip"] = [(indices(a), indices(b)) for a, b in pairs]
    dl = make()
    triples = list(zip(dl, dl, dl))
    out["zip3"] = [tuple(indices(b) for b in t) for t in triples]
    dl = make()
    first = iter(dl)
    held = [next(first) for _ in range(5)]  # into the larger batches: the ring grew
    second = [b for b in iter(dl)]
    rest = [b for b in first]
    out["held"] = [[indices(b) for b in part] for part in (held, second, rest)]
    dl = make()
    nested = []
    for n, outer in enumerate(dl):
        nested.append((indices(outer), [indices(b)[0] for b in dl]))
        if n == 2:
            break
    out["nested"] = nested
    return out


@pytest.fixture(params=["sparse", "whole"])
def ring_kind(request, monkeypatch):
    """Rings made sparse at once, or reserved whole (a large ring made on a thread)."""
    if request.param == "whole":
        monkeypatch.setattr(ring_mod, "_populate_works", False)
    return request.param


@pytest.mark.parametrize("persistent", [False, True])
def test_live_iterators_of_one_loader_yield_what_torchs_yield(persistent, ring_kind):
    theirs = patterns(
        lambda: torch.utils.data.DataLoader(
            Rows(), batch_sampler=GROWING, num_workers=2, persistent_workers=persistent
        )
    )
    ours = patterns(
        lambda: DataLoader(Rows(), batch_sampler=GROWING, num_workers=2, persistent_workers=persistent)
    )
    for name in theirs:
        assert ours[name] == theirs[name], name


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_two_iterators_with_growing_batches_under(method):
    kwargs = {"batch_sampler": GROWING, "num_workers": 2, "multiprocessing_context": method}
    dl = DataLoader(Rows(), **kwargs)
    got = [(indices(a), indices(b)) for a, b in zip(dl, dl)]
    assert got == [(b, b) for b in GROWING]


@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    sizes=st.lists(st.sampled_from([1, 2, 8, 24, 48]), min_size=1, max_size=10),
    schedule=st.lists(
        st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True), st.booleans()),
        max_size=20,
    ),
    persistent=st.booleans(),
)
# (Found by a random run against the code before the fix: the TypeError.)
@example(sizes=[1, 24], schedule=[([0, 2, 1], False), ([0, 1], False)], persistent=False)
@example(sizes=[2, 48, 8, 48], schedule=[([0, 1], True)] * 4 + [([1], True)], persistent=True)
def test_interleaved_iterators_yield_what_torchs_yield(sizes, schedule, persistent):
    """Up to three iterators of one loader, made and stepped in a drawn order: each step
    calls next() on some of them in turn (as zip does), and keeps or drops the batches
    as drawn. What each next() yields (indices, or the end) is torch's."""
    batch_sampler = batches_of(sizes)

    def run(make) -> list:
        dl = make()
        its: list = []
        kept, out = [], []
        for which, keep in schedule:
            for n in which:
                if n >= len(its):
                    its.append(iter(dl))
                    n = len(its) - 1
                batch = next(its[n], None)
                got = None if batch is None else indices(batch)
                out.append((n, got))
                if keep and batch is not None:
                    kept.append((batch, got))
        for batch, expect in kept:
            assert indices(batch) == expect, "a kept batch changed"
        return out

    theirs = run(
        lambda: torch.utils.data.DataLoader(
            Rows(), batch_sampler=batch_sampler, num_workers=2, persistent_workers=persistent
        )
    )
    ours = run(
        lambda: DataLoader(Rows(), batch_sampler=batch_sampler, num_workers=2, persistent_workers=persistent)
    )
    assert ours == theirs
