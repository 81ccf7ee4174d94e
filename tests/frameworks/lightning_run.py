"""Lightning Trainer and Fabric over shmloader, on CPU; records what each rank trained on.

Usage: ``python lightning_run.py OUT single`` (one device) or ``... OUT ddp`` (two CPU
processes, strategy="ddp", gloo: Lightning starts rank 1 by running this script again).
The loaders are seeded with ``seed=0``, or with ``generator=torch.Generator().manual_seed(0)``
where ``FRAMEWORKS_RNG=generator``.

single: ``Trainer.fit`` for 2 epochs with validation (loader built in
``train_dataloader()``), checkpoints every 4 steps (mid-epoch, and at epoch 0's last step,
12), a resume from each, and the same loader iterated by hand (Lightning's epoch e must
be the loader's epoch e); then Fabric ``setup_dataloaders``.

ddp: fit with the loader built inside ``train_dataloader()`` (checkpoints every 3 steps:
mid-epoch and epoch 0's last step, 6), fit with a loader built before ``fit()`` (before
torch.distributed exists) and passed in, fit with ``use_distributed_sampler=False`` and a
loader asked to shard itself (``distributed="auto"``), fit with
``use_distributed_sampler=False`` and a default loader, then the same with torch's loader
(each rank trains and validates on the whole dataset, as with torch's), a resume from each
checkpoint, then Fabric ``setup_dataloaders`` with two processes. Each rank writes
``<OUT>/<mode>_rank<r>.json``.
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import BATCH, CLASSES, FEATURES, N, NumpySamples, ids, out_dir, write
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint

import shmloader

warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, logger) clutters the log
MODE = sys.argv[2]
DEVICES = 2 if MODE == "ddp" else 1
EVERY = 3 if MODE == "ddp" else 4  # checkpoint steps: mid-epoch, then epoch 0's last step


def make_loader(n: int = N, shuffle: bool = True, **kw) -> shmloader.DataLoader:
    if os.environ.get("FRAMEWORKS_ORACLE") == "torch":  # the scripts' own check: torch's loader
        return torch_loader(n, shuffle)
    if os.environ.get("FRAMEWORKS_RNG") == "generator":  # torch's RNG decides, from a generator
        g = torch.Generator().manual_seed(0)
        return shmloader.DataLoader(
            NumpySamples(n), batch_size=BATCH, shuffle=shuffle, num_workers=2, generator=g, **kw
        )
    return shmloader.DataLoader(
        NumpySamples(n), batch_size=BATCH, shuffle=shuffle, num_workers=2, seed=0, **kw
    )


def torch_loader(n: int = N, shuffle: bool = True) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        NumpySamples(n), batch_size=BATCH, shuffle=shuffle, num_workers=2, generator=g
    )


class Model(pl.LightningModule):
    """Records ``{"epoch", "step", "ids"}`` for every training batch, and validation ids."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(FEATURES, CLASSES)
        self.trained: list[dict] = []
        self.validated: list[list[int]] = []
        self.types: list[str] = []

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        if not self.types:
            self.types = [type(x).__name__, str(x.dtype), type(y).__name__, str(y.dtype)]
        self.trained.append({"epoch": self.current_epoch, "step": self.global_step, "ids": ids(i)})
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class InsideModel(Model):
    """The loader is built inside ``train_dataloader()`` (Lightning's usual pattern)."""

    def train_dataloader(self):
        return make_loader()


class ValidatedModel(InsideModel):
    def validation_step(self, batch, batch_idx):
        x, y, i = batch
        if not self.trainer.sanity_checking:
            self.validated.append(ids(i))
        return F.cross_entropy(self.net(x), y)

    def val_dataloader(self):
        return make_loader(40, shuffle=False)


class OwnShardingModel(InsideModel):
    """The loader shards itself (asked to: ``distributed="auto"``)."""

    def train_dataloader(self):
        return make_loader(distributed="auto")


class TorchValidatedModel(ValidatedModel):
    """torch's loaders, for the oracle in the same setup."""

    def train_dataloader(self):
        return torch_loader()

    def val_dataloader(self):
        return torch_loader(40, shuffle=False)


def trainer(**kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        strategy="ddp" if MODE == "ddp" else "auto",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def main() -> None:
    record: dict = {}
    ckpt_dir = os.path.join(out_dir(), f"ckpt_{MODE}")
    outside = make_loader()  # before fit(): torch.distributed is not initialized yet

    model = ValidatedModel() if MODE == "single" else InsideModel()
    save = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=EVERY, save_top_k=-1)
    t = trainer(callbacks=[save])
    t.fit(model)
    rank = t.global_rank
    record["inside"] = model.trained
    record["validated"] = model.validated
    record["types"] = model.types
    record["train_loader"] = type(t.train_dataloader).__mro__[0].__module__
    barrier()

    if MODE == "ddp":
        model = Model()
        trainer(enable_checkpointing=False).fit(model, train_dataloaders=outside)
        record["outside"] = model.trained
        # use_distributed_sampler=False: Lightning leaves the loader alone; asked to, it
        # shards itself
        model = OwnShardingModel()
        trainer(enable_checkpointing=False, use_distributed_sampler=False).fit(model)
        record["own_sharding"] = model.trained
        # not asked to: each rank trains and validates on every sample, as with torch's loader
        for name, model in (("no_sharding", ValidatedModel()), ("torch_no_sharding", TorchValidatedModel())):
            trainer(enable_checkpointing=False, use_distributed_sampler=False).fit(model)
            record[name] = model.trained
            record[f"{name}_validated"] = model.validated
    else:
        # Lightning's epoch e is the loader's epoch e: iterating an identical loader by hand
        # gives the same orders (no extra iter() shifted the loader's epochs).
        by_hand = make_loader()
        record["by_hand"] = [[ids(i) for _, _, i in by_hand] for _ in range(2)]
        del by_hand

    for step in (EVERY, N // BATCH // DEVICES):  # mid-epoch, epoch 0's last step
        model = ValidatedModel() if MODE == "single" else InsideModel()
        path = os.path.join(ckpt_dir, f"step={step}.ckpt")
        trainer(enable_checkpointing=False).fit(model, ckpt_path=path)
        record[f"resume_{step}"] = model.trained
        barrier()

    # Fabric: setup_dataloaders keeps the loader (re-built with a DistributedSampler on 2).
    fabric = Fabric(accelerator="cpu", devices=DEVICES, strategy="ddp" if MODE == "ddp" else "auto")
    fabric.launch()
    net = torch.nn.Linear(FEATURES, CLASSES)
    net, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(make_loader())
    record["fabric_inner"] = type(loader._dataloader).__module__
    record["fabric_len"] = len(loader)
    fabric_ids = []
    for x, y, i in loader:
        opt.zero_grad()
        fabric.backward(F.cross_entropy(net(x), y))
        opt.step()
        fabric_ids.append(ids(i))
    record["fabric"] = fabric_ids
    write(f"{MODE}_rank{rank}", record)
    barrier()  # rank 0 (the test's child) exits only once every rank has written


if __name__ == "__main__":
    main()
