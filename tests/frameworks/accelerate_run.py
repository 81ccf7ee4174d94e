"""Hugging Face Accelerate over shmloader, on CPU; records what each process trained on.

Usage: ``python accelerate_run.py OUT single``, or under torchrun
(``python -m torch.distributed.run --nproc_per_node 2 accelerate_run.py OUT ddp``).
Each process writes ``<OUT>/<mode>_rank<r>.json``:

- ``sync``: per loader route, per epoch, ``accelerator.sync_gradients`` after each step
  under ``accelerator.accumulate`` ("S" synced, "." accumulated), for torch's DataLoader
  through ``accelerator.prepare`` (the oracle), shmloader's through ``accelerator.prepare``
  and through ``shmloader.integrations.accelerate.prepare``;
- ``ids``: per route, per epoch, the sample ids of each batch (``ddp``: this rank's);
- single only: ``save_state`` mid-epoch (in the loop, and after a loop that broke out) and
  at an epoch's last step, ``load_state`` in a new Accelerator, the batches after it
  against the uninterrupted run; what
  ``accelerate.skip_first_batches`` does on a shmloader loader;
- ``skip_<route>`` (every mode): ``accelerator.skip_first_batches`` on this process's
  prepared loader against that loader's epoch.
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches
from common import BATCH, CLASSES, FEATURES, NumpySamples, ids, out_dir, write

import shmloader
from shmloader.integrations.accelerate import prepare

warnings.filterwarnings("ignore")
MODE = sys.argv[2]
ACCUMULATE = 5  # 12 (single) or 6 (per rank, ddp) batches an epoch: ends off a multiple of it


# torch's workers start from a fork server: a rank is multithreaded (torch's queue feeder
# threads, gloo's), and on Python 3.11.7 and older a child forked while another thread
# holds the interpreter's thread-state lock deadlocks before it runs any code (CPython
# gh-112275, fixed in 3.11.8): seen here once in CI, in torch's loader (the oracle). A
# fork server forks from a process with one thread. What this script checks (shares,
# gradient sync, resume) does not depend on the start method. shmloader's loaders keep
# the default fork: what users run.
START = "forkserver"


def shm_loader() -> shmloader.DataLoader:
    return shmloader.DataLoader(NumpySamples(), batch_size=BATCH, shuffle=True, num_workers=2, seed=0)


def torch_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        NumpySamples(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        generator=g,
        multiprocessing_context=START,
    )


def setup(accelerator: Accelerator) -> tuple:
    torch.manual_seed(0)
    net = torch.nn.Linear(FEATURES, CLASSES)
    return accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))


def train(accelerator: Accelerator, net, opt, loader, epochs: int = 2, stop=None) -> dict:
    """Train ``epochs`` epochs; per epoch the sync flags and batch ids. ``stop(epoch, step)``
    is called after each step (for save_state)."""
    out: dict = {"sync": [], "ids": [], "devices": set()}
    for epoch in range(epochs):
        flags, seen = "", []
        for step, (x, y, i) in enumerate(loader):
            with accelerator.accumulate(net):
                loss = F.cross_entropy(net(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            flags += "S" if accelerator.sync_gradients else "."
            seen.append(ids(i))
            out["devices"].add(f"{type(x).__name__}:{x.device}")
            if stop is not None:
                stop(epoch, step)
        out["sync"].append(flags)
        out["ids"].append(seen)
    out["devices"] = sorted(out["devices"])
    return out


ROUTES = ("torch", "accelerate_prepare", "accelerate_prepare_kept", "shmloader_prepare")


def routes(record: dict) -> None:
    """The same training through each loader route, one accelerator each:
    ``accelerate_prepare`` as Accelerate's examples write it (``dl = accelerator.prepare(dl)``
    drops the shmloader loader), ``accelerate_prepare_kept`` with the shmloader loader
    still referenced by the caller while the prepared one trains."""
    for route in ROUTES:
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=True)
        net, opt = setup(accelerator)
        original = None
        try:
            if route == "torch":
                loader = accelerator.prepare(torch_loader())
            elif route == "accelerate_prepare":
                loader = accelerator.prepare(shm_loader())
            elif route == "accelerate_prepare_kept":
                original = shm_loader()
                loader = accelerator.prepare(original)
            else:
                loader = prepare(accelerator, shm_loader())
            record[route] = train(accelerator, net, opt, loader)
            record[route]["class"] = f"{type(loader).__module__}.{type(loader).__qualname__}"
        except Exception as e:  # recorded: the test says which route must work
            record[route] = {"error": f"{type(e).__name__}: {e}"}
        del original
        accelerator.free_memory()


def checkpoints(record: dict, folder: str) -> None:
    """save_state mid-epoch 1 (after its 5th batch) and after epoch 0's last batch;
    load_state each into a new Accelerator and loader; record the batches after it."""
    accelerator = Accelerator(cpu=True)
    net, opt = setup(accelerator)
    loader = prepare(accelerator, shm_loader())
    saved = {}

    def stop(epoch: int, step: int) -> None:
        if (epoch, step) in ((0, len(loader) - 1), (1, 4)):
            path = os.path.join(folder, f"e{epoch}s{step}")
            accelerator.save_state(path)
            saved[path] = (epoch, step)

    record["uninterrupted"] = train(accelerator, net, opt, loader, epochs=3, stop=stop)["ids"]
    accelerator.free_memory()
    # a loop that breaks out after 5 batches of epoch 0, then saves
    accelerator = Accelerator(cpu=True)
    net, opt = setup(accelerator)
    loader = prepare(accelerator, shm_loader())
    for step, _ in enumerate(loader):
        if step == 4:
            break
    path = os.path.join(folder, "break")
    accelerator.save_state(path)
    saved[path] = (0, 4)
    accelerator.free_memory()
    for path, (epoch, step) in saved.items():
        accelerator = Accelerator(cpu=True)
        net, opt = setup(accelerator)
        loader = prepare(accelerator, shm_loader())
        accelerator.load_state(path)
        # the rest of the saved epoch (empty at its last step), then the following one
        rest = [ids(i) for _, _, i in loader]
        following = [ids(i) for _, _, i in loader]
        name = os.path.basename(path) if path.endswith("break") else f"e{epoch}s{step}"
        record[f"resumed_{name}"] = {"epoch": epoch, "step": step, "rest": rest, "next": following}
        accelerator.free_memory()


def skip(record: dict) -> None:
    """accelerate.skip_first_batches(loader, 3) on a shmloader loader: it must yield the
    loader's batches 3.. of its next epoch, or fail loudly; with the loader kept (its next
    epoch is then still those batches), and with the loader dropped once it returned."""
    expected = [ids(i) for _, _, i in shm_loader()][3:]
    loader = shm_loader()
    for case in ("kept", "dropped"):
        try:
            # "dropped": the loader is a temporary, gone once skip_first_batches returned
            skipped = skip_first_batches(loader if case == "kept" else shm_loader(), 3)
            got = [ids(batch[2]) for batch in skipped]
            record[f"skip_first_batches_{case}"] = {"expected": expected, "got": got}
        except Exception as e:
            record[f"skip_first_batches_{case}"] = {"expected": expected, "error": f"{type(e).__name__}: {e}"}
    record["skip_first_batches_kept"]["loader_after"] = [ids(i) for _, _, i in loader][3:]


def generator_loader() -> shmloader.DataLoader:
    g = torch.Generator().manual_seed(0)
    return shmloader.DataLoader(NumpySamples(), batch_size=BATCH, shuffle=True, num_workers=2, generator=g)


def skip_per_rank(record: dict) -> None:
    """accelerator.skip_first_batches(loader, 2) on every process: per route, this
    process's batches of a fresh loader's epoch (``expected``) and what the skipping
    loader yields (``got``). torch's loader through accelerator.prepare is the oracle
    (it yields the epoch minus its first 2 batches); shmloader's adapter over a seeded
    loader and over one with a torch generator (the same seed as torch's)."""
    makers = {
        "torch": lambda acc: acc.prepare(torch_loader()),
        "shmloader_seed": lambda acc: prepare(acc, shm_loader()),
        "shmloader_generator": lambda acc: prepare(acc, generator_loader()),
    }
    for route, make in makers.items():
        accelerator = Accelerator(cpu=True)
        try:
            expected = [ids(i) for _, _, i in make(accelerator)]
            skipped = accelerator.skip_first_batches(make(accelerator), 2)
            got = [ids(batch[2]) for batch in skipped]
            record[f"skip_{route}"] = {"expected": expected, "got": got}
        except Exception as e:
            record[f"skip_{route}"] = {"error": f"{type(e).__name__}: {e}"}
        accelerator.free_memory()


def main() -> None:
    record: dict = {}
    routes(record)
    skip_per_rank(record)
    if MODE == "single":
        checkpoints(record, os.path.join(out_dir(), "states"))
        skip(record)
    rank = int(os.environ.get("RANK", 0))
    write(f"{MODE}_rank{rank}", record)


if __name__ == "__main__":
    main()
