"""torch's RNG decides as in torch (issue 27, items 6 and 7): with no ``seed=``, the shuffled
order, the workers' seeds and every draw in a worker (torch, numpy's global RNG, ``random``,
``torch.initial_seed()``, ``get_worker_info().seed``) are bit-identical to torch's
DataLoader's, drawn when torch draws them, so the program's own draws afterwards match
too; building a loader draws nothing. A resume with ``generator=`` gives the uninterrupted
run's batches in the following epochs.

The oracle is ``torch.utils.data.DataLoader`` on the same dataset, from the same seeds.
"""

from __future__ import annotations

import io
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

import shmloader  # noqa: E402
from shmloader import DataLoader  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Draws:
    """Sample i: i and what the process that loads it draws from each RNG."""

    def __init__(self, n: int = 10) -> None:
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
            "initial_seed": torch.initial_seed() if info is not None else -1,
            "worker_seed": info.seed if info is not None else -1,
        }


class Indexed:
    """Sample i: i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _plain(batch):
    if isinstance(batch, dict):
        return {k: _plain(v) for k, v in batch.items()}
    return batch.tolist() if hasattr(batch, "tolist") else batch


def _run(loader_class, dataset, epochs=3, generator_seed=None, **kwargs):
    """Epochs of a loader made after the program seeded every RNG, and the program's
    next draws from each global RNG once they are over."""
    torch.manual_seed(5)
    np.random.seed(1)
    random.seed(2)
    g = torch.Generator().manual_seed(generator_seed) if generator_seed is not None else None
    loader = loader_class(dataset, generator=g, **kwargs)
    out = [[_plain(b) for b in loader] for _ in range(epochs)]
    out.append(
        {"torch": torch.rand(3).tolist(), "numpy": np.random.rand(2).tolist(), "random": random.random()}
    )
    if hasattr(loader, "shutdown"):
        loader.shutdown()
    return out


WORKERS = [
    pytest.param({"num_workers": 0}, id="main"),
    pytest.param({"num_workers": 1, "multiprocessing_context": "fork"}, id="1worker"),
    pytest.param({"num_workers": 2, "multiprocessing_context": "fork"}, id="2workers"),
    pytest.param(
        {"num_workers": 2, "multiprocessing_context": "fork", "persistent_workers": True}, id="2persistent"
    ),
    pytest.param(
        {"num_workers": 1, "multiprocessing_context": "fork", "persistent_workers": True}, id="1persistent"
    ),
    # Persistent under spawn: a spawned worker imports torch (~4 s on two cores), and
    # fresh workers each epoch are the fork cases' (what spawn adds is the seeds' trip).
    pytest.param(
        {"num_workers": 2, "multiprocessing_context": "spawn", "persistent_workers": True},
        id="2persistent-spawn",
    ),
]


# Under spawn, with torch.manual_seed only: a generator changes where the base seed comes
# from in this process, not what the spawned workers are sent (each spawned worker imports
# torch: ~4 s on two cores).
DRAW_CASES = [
    pytest.param(kw.values[0], seed, id=f"{name}-{kw.id}")
    for name, seed in [("manual_seed", None), ("generator", 7)]
    for kw in WORKERS
    if seed is None or kw.values[0].get("multiprocessing_context") != "spawn"
]


@pytest.mark.parametrize("kw, generator_seed", DRAW_CASES)
def test_order_and_every_draw_in_workers_are_torchs(kw, generator_seed):
    """Same torch.manual_seed (or the same generator seed): the batches of three epochs,
    per sample the draws of the process that loaded it, and the program's draws after
    the epochs are torch's."""
    kwargs = dict(batch_size=3, shuffle=True, **kw)
    expected = _run(TorchLoader, Draws(), generator_seed=generator_seed, **kwargs)
    got = _run(DataLoader, Draws(), generator_seed=generator_seed, **kwargs)
    for epoch, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine == theirs, f"epoch {epoch}" if epoch < 3 else "the program's draws after the epochs"


@pytest.mark.parametrize("kw", WORKERS[:3])
def test_drop_last_and_batch_size_none_keep_torchs_order(kw):
    for extra in ({"batch_size": 4, "drop_last": True}, {"batch_size": None}):
        kwargs = dict(shuffle=True, **extra, **kw)
        assert _run(DataLoader, Indexed(11), **kwargs) == _run(TorchLoader, Indexed(11), **kwargs), extra


@pytest.mark.parametrize("kw", WORKERS[:4])
def test_a_torch_sampler_of_the_users_draws_as_under_torchs_loader(kw):
    """A torch RandomSampler given as ``sampler=`` draws from the global RNG after the
    loader's base seed, as under torch's loader (in a loop nothing draws between iter()
    and the first next())."""

    def run(cls):
        torch.manual_seed(3)
        np.random.seed(1)
        random.seed(2)
        loader = cls(Draws(), batch_size=3, sampler=torch.utils.data.RandomSampler(range(10)), **kw)
        out = [[_plain(b) for b in loader] for _ in range(2)]
        if hasattr(loader, "shutdown"):
            loader.shutdown()
        return out, torch.rand(2).tolist()

    assert run(DataLoader) == run(TorchLoader)


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param({}, id="no-generator"),
        pytest.param({"generator": "torch"}, id="torch-generator"),
        pytest.param({"generator": "numpy"}, id="numpy-generator"),
        pytest.param({"seed": 3}, id="seed"),
    ],
)
@pytest.mark.parametrize("kw", [{"num_workers": 0}, {"num_workers": 2, "persistent_workers": True}])
def test_building_a_loader_draws_nothing(arguments, kw):
    """A model made after the loader gets the weights it gets without the loader: torch's
    DataLoader draws nothing when it is made, nor does ours (from torch's global RNG, a
    generator, or numpy's global RNG)."""
    arguments = dict(arguments)
    g = {"torch": torch.Generator().manual_seed(4), "numpy": np.random.default_rng(4)}.get(
        arguments.pop("generator", None)
    )
    torch.manual_seed(0)
    np.random.seed(0)
    before = (torch.rand(3), np.random.rand(3))
    g_before = g.get_state().clone() if isinstance(g, torch.Generator) else (g and g.bit_generator.state)
    torch.manual_seed(0)
    np.random.seed(0)
    loader = DataLoader(Indexed(8), batch_size=2, shuffle=True, generator=g, **arguments, **kw)
    after = (torch.rand(3), np.random.rand(3))
    assert torch.equal(before[0], after[0]), "building the loader drew from torch's global RNG"
    assert (before[1] == after[1]).all(), "building the loader drew from numpy's global RNG"
    if isinstance(g, torch.Generator):
        assert torch.equal(g.get_state(), g_before), "building the loader drew from its generator"
    elif g is not None:
        assert g.bit_generator.state == g_before, "building the loader drew from its generator"
    loader.shutdown()


def test_a_standalone_random_sampler_is_torchs():
    """shmloader.RandomSampler with torch imported: torch's draws, with and without a
    generator and with replacement (in chunks of 32, as torch's)."""
    cases = [
        {},
        {"replacement": True, "num_samples": 70},
        {"num_samples": 25},
        {"generator": 3},
        {"generator": 3, "replacement": True, "num_samples": 33},
    ]
    for case in cases:

        def order(cls, case=case):
            kw = dict(case)
            if "generator" in kw:
                kw["generator"] = torch.Generator().manual_seed(kw["generator"])
            torch.manual_seed(11)
            sampler = cls(range(10), **kw)
            return [list(sampler), list(sampler), torch.rand(2).tolist()]

        assert order(shmloader.RandomSampler) == order(torch.utils.data.RandomSampler), case


def test_persistent_workers_seed_once_and_sample_rng_changes_each_epoch():
    """torch's persistent workers are seeded once (their RNGs go on across epochs, the
    oracle above); shmloader.sample_rng, drawn from the epoch's seed, still changes with
    every epoch."""

    class SampleDraws(Indexed):
        def __getitem__(self, i):
            return shmloader.sample_rng(i).random()

    loader = DataLoader(SampleDraws(8), batch_size=4, num_workers=2, persistent_workers=True)
    epochs = [sorted(v for b in loader for v in b.tolist()) for _ in range(3)]
    assert len({tuple(e) for e in epochs}) == 3
    loader.shutdown()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 9),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**63 - 1),
    use_generator=st.booleans(),
)
def test_orders_are_torchs_for_any_length_batch_and_seed(n, batch_size, drop_last, seed, use_generator):
    def run(cls):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed ^ 0x5EED) if use_generator else None
        loader = cls(Indexed(n), batch_size=batch_size, shuffle=True, drop_last=drop_last, generator=g)
        epochs = [[b.tolist() for b in loader] for _ in range(2)]
        return epochs, torch.rand(2).tolist()

    assert run(DataLoader) == run(TorchLoader)


# --- item 7: resume with generator= -------------------------------------------------------


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["loader"]


def _loader(kw, generator_seed, dataset_len=22):
    g = torch.Generator().manual_seed(generator_seed)
    return DataLoader(Draws(dataset_len), batch_size=4, shuffle=True, generator=g, **kw)


def _ids(batch):
    return (batch["i"].tolist(), batch["worker_seed"].tolist())


RESUME = [
    pytest.param({"num_workers": 0}, id="main"),
    pytest.param({"num_workers": 2, "multiprocessing_context": "fork"}, id="workers"),
    pytest.param(
        {"num_workers": 2, "multiprocessing_context": "fork", "persistent_workers": True}, id="persistent"
    ),
]


@pytest.mark.parametrize("kw", RESUME)
@pytest.mark.parametrize(
    "where",
    [
        pytest.param(0, id="after-iter"),
        pytest.param(2, id="mid-epoch"),
        pytest.param(6, id="last-batch-out"),
        pytest.param(None, id="epoch-boundary"),
    ],
)
def test_a_resume_with_a_generator_gives_the_uninterrupted_runs_epochs(kw, where):
    """Save in epoch 1 (after iter(), after 2 batches, after its last batch, or after its
    StopIteration), load into a loader whose generator is seeded otherwise: the rest of
    epoch 1 and the two epochs after it are the uninterrupted run's (indices and the
    workers' seeds)."""
    reference = _loader(kw, 3)
    full = [[_ids(b) for b in reference] for _ in range(5)]
    reference.shutdown()

    run = _loader(kw, 3)
    list(run)  # epoch 0
    it = iter(run)
    head = [_ids(b) for b in it] if where is None else [_ids(next(it)) for _ in range(where)]
    state = _roundtrip(run.state_dict())
    del it
    run.shutdown()
    resumed = _loader(kw, 99)
    resumed.load_state_dict(state)
    assert _roundtrip(resumed.state_dict()) == state, "loaded, not iterated: the loaded state"
    epochs = [[_ids(b) for b in resumed] for _ in range(3)]
    resumed.shutdown()
    if where is None or where == len(full[1]):  # the state is the start of epoch 2
        assert head == full[1] and epochs == full[2:5]
    else:
        assert head + epochs[0] == full[1], "the rest of the saved epoch"
        assert epochs[1:] == full[2:4], "the epochs after the resumed one"
    saved = state["generators"]["loader"]  # plain data: a list of ints
    assert isinstance(saved, list) and all(type(v) is int for v in saved)


@pytest.mark.parametrize("kw", RESUME[:2])
def test_a_resume_under_the_global_rng_replays_its_epoch(kw):
    """No generator: the saved epoch's draws are replayed (whatever the global RNG holds
    when the run resumes), and the next epoch draws from torch's global RNG as a torch
    DataLoader's epoch does."""
    torch.manual_seed(8)
    run = DataLoader(Draws(22), batch_size=4, shuffle=True, **kw)
    it = iter(run)
    head = [_ids(next(it)) for _ in range(2)]
    state = _roundtrip(run.state_dict())
    rest = [_ids(b) for b in it]
    torch.manual_seed(1234)
    resumed = DataLoader(Draws(22), batch_size=4, shuffle=True, **kw)
    resumed.load_state_dict(state)
    assert [_ids(b) for b in resumed] == rest
    assert sorted(i for b in head + rest for i in b[0]) == list(range(22))
    torch.manual_seed(77)
    expected = [_ids(b) for b in TorchLoader(Draws(22), batch_size=4, shuffle=True, **kw)]
    torch.manual_seed(77)
    assert [_ids(b) for b in resumed] == expected
    assert state["generators"] == {}, "torch's global RNG is the program's: not saved"


# --- torch's test_dataloader.py::test_shuffler_iterdatapipe, with shmloader's loader ---------


# Under spawn with one buffer size and persistent workers: the buffer's size changes
# nothing a spawned worker is sent, and each spawned worker imports torch (~4 s on two
# cores; fresh workers each epoch are the fork cases').
DATAPIPE_CASES = [
    (buffer_size, *loader)
    for buffer_size in (5, 33)
    for loader in [
        (0, False, None),
        (1, True, "fork"),
        (1, False, "fork"),
        (2, True, "fork"),
        (2, True, "spawn"),
    ]
    if loader[2] != "spawn" or buffer_size == 33
]


@pytest.mark.parametrize("buffer_size, num_workers, persistent, context", DATAPIPE_CASES)
def test_a_datapipe_shuffle_follows_the_global_seed_each_epoch(buffer_size, num_workers, persistent, context):
    """torch's own test (its loader draws the DataPipe graph's shared seed at every
    iter(), so torch.manual_seed before an epoch repeats it), including its teardown
    through the private ``_iterator``."""
    datapipes = pytest.importorskip("torch.utils.data.datapipes")
    expected = list(range(100))

    def make():
        shuffled = datapipes.iter.IterableWrapper(expected).shuffle(buffer_size=buffer_size).sharding_filter()
        return DataLoader(
            shuffled,
            num_workers=num_workers,
            shuffle=True,
            multiprocessing_context=context,
            persistent_workers=persistent,
        )

    def epoch(loader):
        return [int(v) for v in loader]

    dl = make()
    assert sorted(epoch(dl)) == expected  # no seed
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(epoch(dl))
    assert runs[0] == runs[1] and sorted(runs[0]) == expected
    torch.manual_seed(321)
    runs.append(epoch(dl))
    assert runs[0] != runs[2] and sorted(runs[2]) == expected
    if dl._iterator is not None:
        dl._iterator._shutdown_workers()
        dl._iterator = None
    assert dl._iterator is None
