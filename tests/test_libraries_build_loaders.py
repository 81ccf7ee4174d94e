"""Loaders that libraries build themselves through torch's name (issue 42, section 1), with
torch's DataLoader as the oracle.

- ``torch.utils.data.DataLoader`` rebound to shmloader's gives a loader that is an instance
  of torch's class and has torch's private attributes (``_auto_collation``,
  ``_index_sampler``, ``_dataset_kind``) with torch's values;
- :func:`shmloader.patch_torch` makes code that builds torch's loader by name (a library
  stand-in here, timm's ``create_loader`` where timm is installed) get shmloader's, and
  undoes itself exactly;
- the iterator's ``_workers`` and ``loader._iterator = None`` (Lightning's teardown) as in
  torch's, persistent workers included, checked in a child process with a deadline.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmloader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCH_LOADER = torch.utils.data.DataLoader
TORCH_LOADER_IN_MODULE = torch.utils.data.dataloader.DataLoader


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple:
        return torch.tensor([float(i * i)]), i


class Count(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(7))


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b, (a, b)


@pytest.fixture
def torch_names_restored():
    """Whatever a test binds to torch's DataLoader names is undone after it."""
    yield
    torch.utils.data.DataLoader = TORCH_LOADER
    torch.utils.data.dataloader.DataLoader = TORCH_LOADER_IN_MODULE


CASES = [
    (Squares, {"batch_size": 4}),
    (Squares, {"batch_size": None}),
    (Squares, {"batch_size": 3, "shuffle": True, "drop_last": True}),
    (Count, {"batch_size": 2}),
    (Count, {"batch_size": None}),
]


@pytest.mark.parametrize("both_names", [False, True])
@pytest.mark.parametrize(("make", "kwargs"), CASES)
def test_loader_built_through_a_rebound_torch_name_is_torch_shaped(
    make, kwargs, both_names, torch_names_restored
):
    theirs = TORCH_LOADER(make(), **kwargs)
    torch.utils.data.DataLoader = shmloader.DataLoader
    if both_names:
        torch.utils.data.dataloader.DataLoader = shmloader.DataLoader
    mine = torch.utils.data.DataLoader(make(), **kwargs)
    assert isinstance(mine, shmloader.DataLoader)
    assert isinstance(mine, TORCH_LOADER)
    assert mine._auto_collation == theirs._auto_collation
    assert mine._dataset_kind == theirs._dataset_kind
    if theirs._dataset_kind == 0 and not kwargs.get("shuffle"):
        assert list(mine._index_sampler) == list(theirs._index_sampler)
    torch.manual_seed(0)
    want = list(theirs)
    torch.manual_seed(0)
    _same(list(mine), want)


# --- patch_torch -----------------------------------------------------------------------------


def library_builds_by_import(dataset: Any, **kwargs: Any) -> Any:
    """A library's code: the name imported when the function runs."""
    from torch.utils.data import DataLoader

    return DataLoader(dataset, **kwargs)


def library_builds_by_attribute(dataset: Any, **kwargs: Any) -> Any:
    """A library's code: ``torch.utils.data.DataLoader(...)``, as timm's create_loader."""
    return torch.utils.data.DataLoader(dataset, **kwargs)


def library_builds_from_the_module(dataset: Any, **kwargs: Any) -> Any:
    """A library's code: the name in torch's defining module."""
    from torch.utils.data.dataloader import DataLoader

    return DataLoader(dataset, **kwargs)


LIBRARIES = [library_builds_by_import, library_builds_by_attribute, library_builds_from_the_module]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("build", LIBRARIES)
def test_patch_torch_gives_libraries_shmloader_loaders(build, num_workers):
    kwargs = {"batch_size": 3, "shuffle": True, "num_workers": num_workers}
    torch.manual_seed(5)
    want = list(build(Squares(), **kwargs))
    assert not isinstance(build(Squares()), shmloader.DataLoader)
    made_before = TORCH_LOADER(Squares())
    with shmloader.patch_torch():
        loader = build(Squares(), **kwargs)
        assert isinstance(loader, shmloader.DataLoader) and isinstance(loader, TORCH_LOADER)
        assert isinstance(loader, torch.utils.data.DataLoader)
        # torch's own loaders still pass the check against the patched name
        assert isinstance(made_before, torch.utils.data.DataLoader)
        assert issubclass(TORCH_LOADER, torch.utils.data.dataloader.DataLoader)
        torch.manual_seed(5)
        _same(list(loader), want)
    assert torch.utils.data.DataLoader is TORCH_LOADER
    assert torch.utils.data.dataloader.DataLoader is TORCH_LOADER_IN_MODULE
    assert not isinstance(build(Squares()), shmloader.DataLoader)


def test_patch_torch_undo_restores_exactly_what_was_bound_and_is_idempotent(torch_names_restored):
    class Custom(TORCH_LOADER):
        pass

    torch.utils.data.DataLoader = Custom  # someone's own binding, before the patch
    first = shmloader.patch_torch()
    second = shmloader.patch_torch()
    assert isinstance(library_builds_by_attribute(Squares()), shmloader.DataLoader)
    second.undo()
    second.undo()  # a second undo of one handle does nothing
    assert isinstance(library_builds_by_attribute(Squares()), shmloader.DataLoader)
    first.undo()
    assert torch.utils.data.DataLoader is Custom
    assert torch.utils.data.dataloader.DataLoader is TORCH_LOADER_IN_MODULE
    first.undo()
    assert torch.utils.data.DataLoader is Custom


def test_patch_torch_ends_with_its_block_on_error():
    with pytest.raises(KeyError), shmloader.patch_torch():
        raise KeyError("boom")
    assert torch.utils.data.DataLoader is TORCH_LOADER


class TimmImages(torch.utils.data.Dataset):
    """What timm's create_loader needs of a dataset: ``transform``, PIL images."""

    def __init__(self) -> None:
        self.transform = None

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple:
        from PIL import Image

        rng = np.random.default_rng(i)
        img = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))
        return (self.transform(img) if self.transform is not None else img), i


@pytest.mark.timeout(120)
def test_timm_create_loader_through_patch_torch():
    timm_data = pytest.importorskip("timm.data")

    def create() -> Any:
        return timm_data.create_loader(
            TimmImages(),
            input_size=(3, 32, 32),
            batch_size=4,
            is_training=False,
            use_prefetcher=False,
            num_workers=2,
            persistent_workers=True,
        )

    theirs = create()
    assert not isinstance(theirs, shmloader.DataLoader)
    want = [list(theirs) for _ in range(2)]
    theirs._iterator = None
    with shmloader.patch_torch():
        mine = create()
    assert isinstance(mine, shmloader.DataLoader) and isinstance(mine, TORCH_LOADER)
    try:
        for epoch in want:
            got = list(mine)
            assert len(got) == len(epoch)
            for a, b in zip(got, epoch):
                _same(list(a), list(b))
    finally:
        mine._iterator = None


# --- the iterator's _workers, loader._iterator ---------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_iterator_workers_are_processes_as_torchs(persistent):
    def look(loader: Any) -> tuple:
        it = iter(loader)
        workers = it._workers  # read before the first next(), as torch's tests do
        alive = [w.is_alive() for w in workers]
        pids = [w.pid for w in workers]
        batches = list(it)
        return len(workers), alive, all(isinstance(p, int) for p in pids), len(batches), it

    kwargs = {"batch_size": 2, "num_workers": 2, "persistent_workers": persistent}
    theirs = TORCH_LOADER(Squares(), multiprocessing_context="fork", **kwargs)
    mine = shmloader.DataLoader(Squares(), **kwargs)
    *want, their_it = look(theirs)
    *got, my_it = look(mine)
    assert got == want
    if not persistent:  # an exhausted epoch's workers are gone, in both
        for w in their_it._workers:
            w.join(5)
        assert [w.is_alive() for w in my_it._workers] == [w.is_alive() for w in their_it._workers]
        assert not any(w.is_alive() for w in my_it._workers)
    theirs._iterator = None
    mine._iterator = None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_held_past_the_iterator_join_as_torchs(persistent):
    """torch's test_partial_workers: the list read from a live iterator outlives it; after
    a break and ``del``, each worker joins, is not alive and takes terminate() and kill()."""

    def held(make: Any) -> tuple:
        loader = make(Squares(), batch_size=2, num_workers=2, persistent_workers=persistent)
        it = iter(loader)
        workers = it._workers
        for i, _ in enumerate(it):
            if i == 1:
                break
        del it
        loader._iterator = None  # (persistent: the loader holds the iterator)
        gc.collect()
        for w in workers:
            w.join(10)
        states = [w.is_alive() for w in workers]
        for w in workers:
            w.terminate()
            w.kill()
        return states, [w.exitcode is not None for w in workers]

    want = held(lambda *a, **k: TORCH_LOADER(*a, multiprocessing_context="fork", **k))
    got = held(shmloader.DataLoader)
    assert got == want == ([False, False], [True, True])


_TEARDOWN = """
import gc, json, sys, time
import psutil, torch, shmloader

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        return torch.tensor([float(i)])

which = sys.argv[1]
make = torch.utils.data.DataLoader if which == "torch" else shmloader.DataLoader
loader = make(Squares(), batch_size=2, num_workers=2, persistent_workers=True)
for _ in range(2):
    for batch in loader:
        pass
pids = [w.pid for w in loader._iterator._workers]
before = [psutil.Process(p).is_running() for p in pids]
loader._iterator = None  # what Lightning does at teardown
gc.collect()

def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True

deadline = time.monotonic() + 10
while time.monotonic() < deadline and not all(map(gone, pids)):
    time.sleep(0.05)
print(json.dumps({"workers": len(pids), "running_before": before, "gone": [gone(p) for p in pids],
                  "iterator": loader._iterator is None, "alive_loader": loader is not None}))
"""


def _run_with_deadline(args: list[str], deadline: float) -> tuple[int, str, str]:
    env = dict(os.environ)
    src = str(Path(shmloader.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -9, out, err
    return proc.returncode, out, err


@pytest.mark.timeout(120)
def test_setting_iterator_to_none_stops_persistent_workers_as_torchs():
    """Lightning's teardown (``loader._iterator = None``) while the loader lives on: the
    persistent workers exit, as torch's do. In a child process with a deadline."""
    results = {}
    for which in ("torch", "ours"):
        rc, out, err = _run_with_deadline(["-c", textwrap.dedent(_TEARDOWN), which], 60)
        assert rc == 0, f"{which}: exit {rc}\n{out[-2000:]}\n{err[-3000:]}"
        results[which] = json.loads(out.strip().splitlines()[-1])
    want = {"workers": 2, "running_before": [True, True], "gone": [True, True], "iterator": True}
    assert results["torch"] == {**want, "alive_loader": True}
    assert results["ours"] == results["torch"]
