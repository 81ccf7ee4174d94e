"""The last RNG differences with torch (issue 42, section 3), each against torch's
DataLoader on the same dataset from the same seeds:

- ``loader.batch_sampler`` draws its epoch's order at its first ``next()``, as torch's
  BatchSampler, not at ``iter()``: torch's DataLoader makes two iterators of it per epoch
  and advances one, so a torch loader rebuilt over ours (``accelerator.prepare`` with one
  process does that) loads torch's order and the program's draws afterwards are torch's;
- with ``generator=`` and ``shuffle=True`` the shuffle's last draw (a ``randperm`` it
  yields nothing of) is made when torch's sampler runs out, so an unfinished epoch (a
  ``break``, ``next(iter(loader))``) leaves the generator where torch's loader leaves it;
- ``persistent_workers=True`` and an epoch left after some batches: each worker has
  loaded (and drawn its RNGs for) the batches torch's had been sent, so every later
  epoch's augmentations are torch's, map-style and iterable.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

from shmloader import DataLoader  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class Augmented:
    """Sample i: i and what the process loading it draws from torch, numpy and random
    (a random augmentation), and the worker's seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        info = torch.utils.data.get_worker_info()
        return {
            "i": i,
            "torch": torch.rand(()).item(),
            "numpy": float(np.random.rand()),
            "random": random.random(),
            "worker_seed": info.seed if info is not None else -1,
        }


class AugmentedStream(IterableDataset):
    """Samples ``worker_id, worker_id + num_workers, ...`` below n, each with the draws of
    :class:`Augmented`."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, count = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, count):
            yield {"i": i, "torch": torch.rand(()).item(), "numpy": float(np.random.rand())}


def _plain(batch: dict) -> dict:
    return {k: v.tolist() for k, v in batch.items()}


def _seed_everything() -> None:
    torch.manual_seed(5)
    np.random.seed(1)
    random.seed(2)


def _program_draws(generator=None) -> dict:
    out = {"torch": torch.rand(3).tolist(), "numpy": np.random.rand(2).tolist(), "random": random.random()}
    if generator is not None:
        out["generator"] = torch.randint(0, 10**6, (3,), generator=generator).tolist()
    return out


def _close(loader) -> None:
    if hasattr(loader, "shutdown"):
        loader.shutdown()


# --- the loader's batch sampler draws at its first next() ---------------------------------


def _rebuilt(loader_class, num_workers: int, generator_seed: int | None) -> list:
    """Two epochs of a torch DataLoader rebuilt over ``loader.batch_sampler`` (as
    ``accelerator.prepare`` rebuilds one), then the program's draws."""
    _seed_everything()
    g = torch.Generator().manual_seed(generator_seed) if generator_seed is not None else None
    loader = loader_class(Augmented(14), batch_size=3, shuffle=True, generator=g)
    out = []
    for _ in range(2):
        rebuilt = TorchLoader(loader.dataset, batch_sampler=loader.batch_sampler, num_workers=num_workers)
        out.append([_plain(b) for b in rebuilt])
    out.append(_program_draws(g))
    _close(loader)
    return out


@pytest.mark.parametrize("generator_seed", [None, 7], ids=["global-rng", "generator"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_torch_loader_rebuilt_over_the_batch_sampler_loads_torchs_epochs(num_workers, generator_seed):
    """torch's DataLoader iterates the batch sampler twice per epoch with workers (its
    iterator's __init__ and _reset) and advances the second: the order, the workers'
    draws and the program's draws after two epochs are those of a loader rebuilt over
    torch's batch sampler."""
    expected = _rebuilt(TorchLoader, num_workers, generator_seed)
    got = _rebuilt(DataLoader, num_workers, generator_seed)
    assert got == expected


def test_iterating_the_batch_sampler_draws_nothing_before_its_first_next():
    """``iter(loader.batch_sampler)`` alone moves neither torch's global RNG nor the
    generator, as ``iter()`` of torch's BatchSampler over a RandomSampler."""
    for loader_class in (TorchLoader, DataLoader):
        g = torch.Generator().manual_seed(3)
        loader = loader_class(Augmented(10), batch_size=4, shuffle=True, generator=g)
        before = (torch.get_rng_state().clone(), g.get_state().clone())
        it = iter(loader.batch_sampler)
        after = (torch.get_rng_state(), g.get_state())
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), loader_class
        assert sorted(i for b in it for i in b) == list(range(10))
        _close(loader)


def test_the_accelerate_adapters_batch_sampler_draws_at_its_first_next():
    """``prepare(accelerator, loader).batch_sampler`` (what ``skip_first_batches``
    rebuilds a loader over) draws as torch's batch sampler does: nothing at ``iter()``,
    the order at the first ``next()``."""
    from types import SimpleNamespace

    from shmloader.integrations.accelerate import prepare

    accelerator = SimpleNamespace(
        split_batches=False,
        dispatch_batches=None,
        device="cpu",
        gradient_state=None,
        process_index=0,
        num_processes=1,
    )
    orders = []
    for loader_class in (TorchLoader, DataLoader):
        torch.manual_seed(9)
        loader = loader_class(Augmented(10), batch_size=4, shuffle=True)
        if loader_class is DataLoader:
            sampler = prepare(accelerator, loader, device_placement=False, checkpoint=False).batch_sampler
        else:
            sampler = loader.batch_sampler
        before = torch.get_rng_state().clone()
        first, second = iter(sampler), iter(sampler)
        assert torch.equal(before, torch.get_rng_state()), loader_class
        orders.append((list(second), list(first), torch.rand(2).tolist()))
        _close(loader)
    assert orders[1] == orders[0]


# --- an unfinished epoch with generator= ----------------------------------------------------

UNFINISHED = [
    pytest.param({"num_workers": 0}, id="main"),
    pytest.param({"num_workers": 2, "multiprocessing_context": "fork"}, id="2workers"),
    pytest.param(
        {"num_workers": 2, "multiprocessing_context": "fork", "persistent_workers": True}, id="2persistent"
    ),
]


def _unfinished(loader_class, kw: dict, n: int, batch_size: int, taken: int, drop_last: bool) -> list:
    """An epoch left after ``taken`` batches, a validation loader sharing the generator
    run meanwhile, two whole epochs, then the program's and the generator's draws."""
    _seed_everything()
    g = torch.Generator().manual_seed(11)
    loader = loader_class(
        Augmented(n), batch_size=batch_size, shuffle=True, generator=g, drop_last=drop_last, **kw
    )
    val = loader_class(Augmented(6), batch_size=3, generator=g, **kw)
    out = []
    for k, batch in enumerate(loader):
        out.append(_plain(batch))
        if k + 1 == taken:
            break
    out.append([_plain(b) for b in val])  # its workers' seeds come from the shared generator
    out += [[_plain(b) for b in loader] for _ in range(2)]
    out.append(_program_draws(g))
    _close(loader)
    _close(val)
    return out


@pytest.mark.parametrize("kw", UNFINISHED)
@pytest.mark.parametrize(
    "n, batch_size, taken, drop_last",
    [
        pytest.param(24, 4, 1, False, id="peek"),
        pytest.param(22, 4, 2, False, id="break-short-last"),
        pytest.param(22, 4, 3, True, id="break-drop-last"),
        pytest.param(24, 4, 5, False, id="break-near-the-end"),
    ],
)
def test_an_unfinished_epoch_leaves_the_generator_where_torchs_does(kw, n, batch_size, taken, drop_last):
    """The shuffle's last randperm is drawn when torch's sampler runs out, not with the
    order: after a ``break`` or a peek, the validation loader's worker seeds, the later
    epochs' orders and seeds and the generator's next draws are torch's."""
    expected = _unfinished(TorchLoader, kw, n, batch_size, taken, drop_last)
    got = _unfinished(DataLoader, kw, n, batch_size, taken, drop_last)
    assert got == expected


# --- persistent workers after a peek ---------------------------------------------------------


def _peeked(loader_class, dataset, num_workers: int, taken: int, **kwargs) -> list:
    """A persistent loader's first epoch left after ``taken`` batches, then two whole
    epochs (each sample with its worker's draws)."""
    _seed_everything()
    loader = loader_class(
        dataset,
        batch_size=2,
        num_workers=num_workers,
        persistent_workers=True,
        multiprocessing_context="fork",
        **kwargs,
    )
    out = []
    for k, batch in enumerate(loader):
        out.append(_plain(batch))
        if k + 1 == taken:
            break
    out += [[_plain(b) for b in loader] for _ in range(2)]
    out.append(_program_draws())
    _close(loader)
    return out


@pytest.mark.parametrize("prefetch_factor", [None, 3])
@pytest.mark.parametrize("taken", [1, 2])
@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_persistent_workers_after_a_peek_draw_torchs_augmentations(kind, num_workers, taken, prefetch_factor):
    """torch's workers load every task its iterator sent before the next epoch
    (``prefetch_factor`` per worker ahead of the batches handed out): ours load as many,
    so their torch, numpy and random streams are where torch's are in every later
    epoch."""
    dataset = Augmented(20) if kind == "map" else AugmentedStream(20)
    kwargs = {} if prefetch_factor is None else {"prefetch_factor": prefetch_factor}
    expected = _peeked(TorchLoader, dataset, num_workers, taken, **kwargs)
    got = _peeked(DataLoader, dataset, num_workers, taken, **kwargs)
    assert got == expected


@pytest.mark.parametrize("kw", UNFINISHED)
def test_a_resume_before_the_shuffles_last_draw_makes_it_where_the_saved_run_would(kw):
    """A state saved after two batches, while the shuffle's last draw is still owed:
    the resumed loader makes it where the uninterrupted run did, so the epochs after the
    resumed one are the uninterrupted run's (orders and worker seeds)."""

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        return DataLoader(Augmented(24), batch_size=4, shuffle=True, generator=g, **kw)

    def ids(batch):
        return batch["i"].tolist(), batch["worker_seed"].tolist()

    reference = make(3)
    full = [[ids(b) for b in reference] for _ in range(3)]
    _close(reference)
    run = make(3)
    it = iter(run)
    head = [ids(next(it)) for _ in range(2)]  # (even: the resumed workers start at worker 0)
    state = run.state_dict()
    del it
    _close(run)
    resumed = make(99)
    resumed.load_state_dict(state)
    epochs = [[ids(b) for b in resumed] for _ in range(2)]
    _close(resumed)
    assert head + epochs[0] == full[0]
    assert epochs[1] == full[1]
