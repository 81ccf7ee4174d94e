"""shmloader inside real torch training stacks (issue 13): the PyTorch tutorial loop,
Lightning (Trainer on one device and DDP on two CPU processes, checkpoint and resume),
Fabric, Accelerate (gradient accumulation, save_state/load_state, torchrun), and the
attributes those frameworks read.

The framework runs are scripts in tests/frameworks/, run as child processes with a
deadline (Lightning's DDP and torchrun start processes of their own); each records what
every rank trained on as JSON, and the assertions here read it. One script run serves
several assertions: importing Lightning costs seconds per process.

torchvision cannot import here (its CPU wheel needs CUDA libraries), so its datasets are
stood in for by a pure-Python dataset returning what ``FakeData(transform=ToTensor())``
returns: a float image tensor and an int label.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from importlib.util import find_spec

import numpy as np
import psutil
import pytest

torch = pytest.importorskip("torch")

import shmloader  # noqa: E402

from .frameworks import common as C  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "frameworks")
SRC = os.path.dirname(os.path.dirname(os.path.abspath(shmloader.__file__)))


def run_script(out, *args: str, timeout: float) -> None:
    """Run ``args`` (a python command line) with this checkout's shmloader, in its own
    process group; on a timeout kill the whole group (ranks, workers) and fail."""
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [sys.executable, *args],
        env=env,
        cwd=str(out),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: the group alone misses them.
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        output, _ = proc.communicate()
        pytest.fail(f"{args} did not finish in {timeout} s:\n{output.decode(errors='replace')[-4000:]}")
    assert proc.returncode == 0, f"{args} failed:\n{output.decode(errors='replace')[-6000:]}"


def load(out, name: str) -> dict:
    with open(os.path.join(str(out), f"{name}.json")) as f:
        return json.load(f)


def assert_shards(per_rank: list[list[list[int]]], n: int = C.N) -> None:
    """One epoch's batches per rank: equal counts, disjoint, together every sample once."""
    flat = [[i for batch in batches for i in batch] for batches in per_rank]
    assert len({len(f) for f in flat}) == 1, f"ranks got different counts: {[len(f) for f in flat]}"
    everything = [i for f in flat for i in f]
    assert sorted(everything) == list(range(n)), (
        f"ranks' shares overlap or miss samples: {len(everything)} ids, {len(set(everything))} distinct"
    )


def by_epoch(trained: list[dict], epochs: int = 2) -> list[list[list[int]]]:
    return [[b["ids"] for b in trained if b["epoch"] == e] for e in range(epochs)]


def after(trained: list[dict], step: int) -> list[tuple]:
    return [(b["epoch"], b["step"], b["ids"]) for b in trained if b["step"] >= step]


# --- the PyTorch tutorial loop ------------------------------------------------------------


def _datasets():
    n = 40
    tensors = torch.utils.data.TensorDataset(
        torch.arange(n * C.FEATURES, dtype=torch.float32).reshape(n, C.FEATURES) / n,
        torch.arange(n) % C.CLASSES,
    )
    return {
        "numpy": C.NumpyPairs(n),
        "TensorDataset": tensors,
        "int-labelled": C.IntLabelled(n),
    }


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["numpy", "TensorDataset", "int-labelled"])
def test_tutorial_loop(kind):
    """``for x, y in loader: loss = F.cross_entropy(model(x), y)`` with the default output
    and two workers: the batches are tensors equal to torch's DataLoader's, and train."""
    F = torch.nn.functional
    dataset = _datasets()[kind]
    ours = shmloader.DataLoader(dataset, batch_size=C.BATCH, num_workers=2)
    # torch's batches, copied out of its shared memory (a failed assertion keeps them alive)
    theirs = [
        [v.clone() for v in b]
        for b in torch.utils.data.DataLoader(dataset, batch_size=C.BATCH, num_workers=2)
    ]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(C.FEATURES, C.CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    for x, y in ours:
        for a, b in zip((x, y), theirs[steps]):
            assert isinstance(a, torch.Tensor), f"{kind}: got {type(a).__name__}, torch gives a Tensor"
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        steps += 1
    assert steps == len(ours) == len(theirs) == 5
    del ours


# --- attributes frameworks read -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_attributes_as_torch():
    """isinstance, collate_fn, samplers, pin_memory_device, len and tqdm totals as torch's."""
    tqdm = pytest.importorskip("tqdm").tqdm
    data = torch.utils.data
    dataset = C.NumpySamples(42)
    for kw in ({}, {"shuffle": True}, {"drop_last": True}, {"batch_size": 5, "shuffle": True}):
        kw = {"batch_size": C.BATCH, **kw}
        ours = shmloader.DataLoader(dataset, num_workers=2, **kw)
        theirs = data.DataLoader(dataset, num_workers=2, **kw)
        assert isinstance(ours, data.DataLoader)
        assert ours.collate_fn is theirs.collate_fn is data.default_collate
        assert isinstance(ours.sampler, data.Sampler) and isinstance(ours.batch_sampler, data.Sampler)
        assert isinstance(ours.batch_sampler, data.BatchSampler)
        kind = data.RandomSampler if kw.get("shuffle") else data.SequentialSampler
        assert isinstance(ours.sampler, kind), f"{kw}: sampler is {type(ours.sampler).__name__}"
        assert ours.pin_memory_device == theirs.pin_memory_device == ""
        assert len(ours) == len(theirs), kw
        assert (ours.batch_size, ours.drop_last) == (theirs.batch_size, theirs.drop_last)
        bar = tqdm(ours, disable=True)
        assert bar.total == len(theirs)
        assert sum(1 for _ in bar) == len(theirs), kw
        del ours, bar
    unbatched = shmloader.DataLoader(dataset, batch_size=None)
    assert unbatched.collate_fn is data.default_convert
    assert len(unbatched) == len(dataset)


# --- Lightning and Fabric ---------------------------------------------------------------------

needs_lightning = pytest.mark.skipif(find_spec("lightning") is None, reason="lightning is not installed")


@needs_lightning
@pytest.mark.timeout(180)
@pytest.mark.parametrize("rng", ["seed", "generator"])
def test_lightning_one_device(tmp_path, monkeypatch, rng):
    """Trainer.fit, 2 epochs with validation, loader built in train_dataloader(); resume from
    a mid-epoch checkpoint and from one at epoch 0's last step; Fabric setup_dataloaders.
    Loaders seeded with seed=0, or with a torch generator (whose state the checkpoint
    must carry for the epochs after a resume)."""
    monkeypatch.setenv("FRAMEWORKS_RNG", rng)
    run_script(tmp_path, os.path.join(SCRIPTS, "lightning_run.py"), str(tmp_path), "single", timeout=170)
    r = load(tmp_path, "single_rank0")
    assert r["train_loader"].startswith("shmloader"), f"Lightning trained with {r['train_loader']}"
    assert r["types"] == ["Tensor", "torch.float32", "Tensor", "torch.int64"]
    epochs = by_epoch(r["inside"])
    for e, batches in enumerate(epochs):
        assert len(batches) == C.N // C.BATCH, f"epoch {e}: {len(batches)} batches"
        assert_shards([batches])
    assert epochs[0] != epochs[1], "both epochs had the same order"
    # Lightning's epoch e is the loader's epoch e (no probing iter() moved its epochs)
    assert r["by_hand"] == epochs
    assert len(r["validated"]) == 2 * 5
    for e in range(2):
        assert sorted(i for b in r["validated"][5 * e : 5 * e + 5] for i in b) == list(range(40))
    # resume: exactly the batches the uninterrupted run trained after the checkpoint
    for step in (4, 12):
        assert after(r[f"resume_{step}"], step) == after(r["inside"], step), f"resume at step {step}"
        assert len(r[f"resume_{step}"]) == 24 - step, f"resume at step {step}"
    assert r["fabric_inner"].startswith("shmloader")
    assert r["fabric_len"] == len(r["fabric"]) == 12
    assert_shards([r["fabric"]])


@needs_lightning
@pytest.mark.timeout(300)
def test_lightning_ddp_two_processes(tmp_path):
    """strategy="ddp" on 2 CPU processes (gloo): loader built in train_dataloader() and
    built before fit() (before torch.distributed exists) and passed in, and with
    use_distributed_sampler=False and distributed="auto" (the loader shards itself): per
    epoch the ranks' shares are disjoint, complete and equal; with
    use_distributed_sampler=False and a default loader, each rank trains and validates on
    the whole dataset every epoch, as with torch's loader; resume from a mid-epoch
    checkpoint and from one at epoch 0's last step trains what the uninterrupted run did;
    Fabric with 2 processes likewise."""
    run_script(tmp_path, os.path.join(SCRIPTS, "lightning_run.py"), str(tmp_path), "ddp", timeout=290)
    ranks = [load(tmp_path, f"ddp_rank{r}") for r in range(2)]
    for r in ranks:
        assert r["train_loader"].startswith("shmloader"), f"Lightning trained with {r['train_loader']}"
        assert r["types"] == ["Tensor", "torch.float32", "Tensor", "torch.int64"]
    for fit in ("inside", "outside", "own_sharding"):
        per_rank = [by_epoch(r[fit]) for r in ranks]
        for e in range(2):
            assert [len(p[e]) for p in per_rank] == [6, 6], f"{fit}, epoch {e}"
            assert_shards([p[e] for p in per_rank])
    for fit in ("torch_no_sharding", "no_sharding"):  # torch's loader first: the oracle
        for k, r in enumerate(ranks):
            per_epoch = by_epoch(r[fit])
            assert [len(e) for e in per_epoch] == [12, 12], f"{fit}, rank {k}"
            for e in range(2):
                assert_shards([per_epoch[e]])  # every sample once, on this rank alone
                validated = r[f"{fit}_validated"][5 * e : 5 * e + 5]
                assert sorted(i for b in validated for i in b) == list(range(40)), f"{fit}, rank {k}"
    for step in (3, 6):
        for k, r in enumerate(ranks):
            assert after(r[f"resume_{step}"], step) == after(r["inside"], step), f"rank {k}, resume at {step}"
            assert len(r[f"resume_{step}"]) == 12 - step
    for r in ranks:
        assert r["fabric_inner"].startswith("shmloader")
        assert r["fabric_len"] == len(r["fabric"]) == 6
    assert_shards([r["fabric"] for r in ranks])


# --- Accelerate ----------------------------------------------------------------------------

needs_accelerate = pytest.mark.skipif(find_spec("accelerate") is None, reason="accelerate is not installed")


def _check_routes(r: dict) -> None:
    """Gradient accumulation syncs where it does with torch's loader (on the last batch of
    every epoch), through accelerator.prepare and through shmloader's adapter."""
    torch_route = r["torch"]
    assert "error" not in torch_route, torch_route
    for route in ("accelerate_prepare", "accelerate_prepare_kept", "shmloader_prepare"):
        got = r[route]
        assert "error" not in got, f"{route}: {got['error']}"
        assert got["sync"] == torch_route["sync"], (
            f"{route} synced {got['sync']}, torch {torch_route['sync']}"
        )
        assert got["devices"] == ["Tensor:cpu"], route
    assert r["shmloader_prepare"]["class"] == "shmloader.integrations.accelerate.AcceleratedLoader"


@needs_accelerate
@pytest.mark.timeout(150)
def test_accelerate_one_process(tmp_path):
    """accelerator.prepare and shmloader's adapter under gradient accumulation (torch's
    loader is the oracle); save_state/load_state mid-epoch and at an epoch's last step;
    accelerate.skip_first_batches yields the loader's batches or fails loudly."""
    run_script(tmp_path, os.path.join(SCRIPTS, "accelerate_run.py"), str(tmp_path), "single", timeout=140)
    r = load(tmp_path, "single_rank0")
    _check_routes(r)
    assert r["torch"]["sync"] == ["....S....S.S"] * 2
    for route in ("accelerate_prepare", "accelerate_prepare_kept", "shmloader_prepare"):
        for epoch in r[route]["ids"]:
            assert_shards([epoch])
    full = r["uninterrupted"]
    assert [len(e) for e in full] == [12, 12, 12]
    mid = r["resumed_e1s4"]
    assert mid["rest"] == full[1][5:] and mid["next"] == full[2], "load_state mid-epoch"
    broke = r["resumed_break"]
    assert broke["rest"] == full[0][5:] and broke["next"] == full[1], "load_state after a loop broke out"
    end = r["resumed_e0s11"]
    assert (end["rest"], end["next"]) == (full[1], full[2]), (
        "load_state at an epoch's last step: the next iter() must load the next epoch whole"
    )
    for case in ("kept", "dropped"):  # the loader kept by the caller, or dropped at once
        skip = r[f"skip_first_batches_{case}"]
        assert "error" in skip or skip["got"] == skip["expected"], (
            f"accelerate.skip_first_batches on a shmloader loader ({case}) silently yielded other batches"
        )
    kept = r["skip_first_batches_kept"]
    assert kept["loader_after"] == kept["expected"], "skip_first_batches moved the loader's epoch"
    _check_skips([r])


@needs_accelerate
@pytest.mark.timeout(150)
def test_accelerate_torchrun_two_processes(tmp_path):
    """torchrun --nproc_per_node 2: through shmloader's adapter and accelerator.prepare, per
    epoch the processes' shares are disjoint, complete and equal, and gradient
    accumulation syncs as with torch's loader."""
    run_script(
        tmp_path,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--standalone",
        os.path.join(SCRIPTS, "accelerate_run.py"),
        str(tmp_path),
        "ddp",
        timeout=140,
    )
    ranks = [load(tmp_path, f"ddp_rank{k}") for k in range(2)]
    for r in ranks:
        _check_routes(r)
        assert r["torch"]["sync"] == ["....SS"] * 2
    for route in ("torch", "accelerate_prepare", "accelerate_prepare_kept", "shmloader_prepare"):
        for e in range(2):
            assert_shards([r[route]["ids"][e] for r in ranks])
    _check_skips(ranks)


def _check_skips(ranks: list[dict]) -> None:
    """accelerator.skip_first_batches(loader, 2) yields each process's share of the epoch
    minus its first 2 batches, as with torch's loader (the oracle, checked too), with a
    seed and with a torch generator."""
    for route in ("torch", "shmloader_seed", "shmloader_generator"):
        for rank, r in enumerate(ranks):
            skip = r[f"skip_{route}"]
            assert "error" not in skip, f"{route}: {skip['error']}"
            assert skip["got"] == skip["expected"][2:], f"{route}, rank {rank}: not its epoch minus 2 batches"
        if len(ranks) > 1:
            assert_shards([r[f"skip_{route}"]["expected"] for r in ranks])


@pytest.mark.timeout(30)
def _first_fields(samples: list) -> tuple:
    """A user collate_fn: a tensor of the features, the labels as numpy."""
    return torch.from_numpy(np.stack([s[0] for s in samples])), np.stack([s[1] for s in samples])


def test_accelerate_adapter_refuses_what_it_cannot_honour():
    """prepare() fails loudly, naming the remedy, where the wrapped loader would not load
    this process's share as Accelerate expects (no Accelerate needed: a stand-in)."""
    from types import SimpleNamespace

    from shmloader.integrations.accelerate import prepare

    def accelerator(**kw):
        base = dict(
            device=torch.device("cpu"),
            process_index=0,
            num_processes=1,
            split_batches=False,
            dispatch_batches=None,
            device_placement=True,
            non_blocking=False,
            gradient_state=None,
            register_for_checkpointing=lambda *objects: None,
        )
        return SimpleNamespace(**{**base, **kw})

    loader = shmloader.DataLoader(C.NumpySamples(8), batch_size=4, output="torch")
    with pytest.raises(ValueError, match="rank 0 of 1 but this accelerator process is 1 of 2"):
        prepare(accelerator(process_index=1, num_processes=2), loader)
    with pytest.raises(ValueError, match="batch_size // num_processes"):
        prepare(accelerator(split_batches=True), loader)
    with pytest.raises(ValueError, match="output='torch'"):
        prepare(accelerator(), shmloader.DataLoader(C.NumpySamples(8), batch_size=4, output="numpy"))
    with pytest.raises(TypeError, match=r"accelerator\.prepare"):
        prepare(accelerator(), torch.utils.data.DataLoader(C.NumpySamples(8)))
    # A collate_fn's output is handed out as it returns it (output="auto" reads "numpy"):
    # its tensors are placed, its numpy arrays stay on the host, as under torch's loader.
    own = shmloader.DataLoader(C.NumpySamples(8), batch_size=4, collate_fn=_first_fields)
    assert own.output == "numpy" and len(prepare(accelerator(), own)) == 2
    wrapped = prepare(accelerator(), loader)
    assert len(wrapped) == 2 and wrapped.dataset is loader.dataset and wrapped.total_batch_size == 4
    assert loader.distributed == "auto", "prepare() shards a loader built without distributed="
    # A DistributedSampler shards it (the loader itself does not): its ranks are checked.
    ds = C.NumpySamples(8)
    sampled = shmloader.DataLoader(
        ds, batch_size=2, sampler=torch.utils.data.DistributedSampler(ds, 2, 1, shuffle=False), output="torch"
    )
    wrapped = prepare(accelerator(process_index=1, num_processes=2), sampled)
    assert sampled.distributed is False and (len(wrapped), wrapped.total_batch_size) == (2, 4)
    with pytest.raises(ValueError, match="rank 1 of 2 but this accelerator process is 0 of 2"):
        prepare(accelerator(process_index=0, num_processes=2), sampled)
