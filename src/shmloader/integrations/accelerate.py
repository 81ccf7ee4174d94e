"""Hugging Face Accelerate with shmloader's workers: :func:`prepare`.

``accelerator.prepare(loader)`` accepts a ``shmloader.DataLoader`` (it is a torch
DataLoader where torch is imported) but rebuilds it as Accelerate's ``DataLoaderShard``:
a plain ``torch.utils.data.DataLoader`` over the loader's dataset and batch sampler,
with torch's workers. The shared-memory ring, zero-copy batches, shmloader's collate
modes, ``state_dict``/``load_state_dict`` and the loader's own sharding are gone.
Use instead::

    from shmloader.integrations.accelerate import prepare

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, opt = accelerator.prepare(model, opt)
    loader = prepare(accelerator, shmloader.DataLoader(ds, batch_size=64, shuffle=True, num_workers=8))
    for x, y in loader:  # on accelerator.device, this rank's share
        with accelerator.accumulate(model):
            ...

The returned :class:`AcceleratedLoader` iterates the shmloader loader itself and does
what ``DataLoaderShard`` does around it: it moves batches to ``accelerator.device``,
tells ``accelerator.gradient_state`` when an epoch begins and ends and marks the last
batch (``end_of_dataloader``, found by looking one batch ahead) so gradient accumulation
syncs on the last batch of every epoch, and it is saved and restored by
``accelerator.save_state`` / ``load_state`` (``register_for_checkpointing``) with the
loader's exact position. Sharding is the loader's: each rank loads a disjoint share of
every epoch, by ``torch.distributed``'s rank and world size (which Accelerate
initializes). As ``accelerator.prepare`` shards a torch loader, :func:`prepare` turns on
the loader's own sharding (``distributed="auto"``) where its constructor left it off.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["AcceleratedLoader", "prepare"]


def prepare(
    accelerator: Any,
    loader: Any,
    *,
    device_placement: bool | None = None,
    non_blocking: bool | None = None,
    checkpoint: bool = True,
) -> AcceleratedLoader:
    """Wrap ``loader`` (a ``shmloader.DataLoader``) for ``accelerator``, keeping its workers.

    ``device_placement`` (default: the accelerator's) moves every batch to
    ``accelerator.device``; ``non_blocking`` (default: the accelerator's dataloader
    config) makes those copies asynchronous (useful with ``pin_memory=True``).
    ``checkpoint=True`` registers the wrapper with ``accelerator.register_for_checkpointing``
    so ``save_state`` / ``load_state`` save and restore its position: call ``prepare``
    in the same order on resume, as for every registered object.

    A loader that does not shard by itself (built without ``distributed=``, ``rank=`` or
    ``world_size=``) and has no ``DistributedSampler`` is switched to
    ``distributed="auto"``: each process loads its share, as ``accelerator.prepare`` gives
    a torch loader's.

    Raises ``ValueError`` when the loader and the accelerator disagree on the rank or the
    world size (the loader was built with an explicit ``rank``, or a
    ``DistributedSampler`` over other ranks),
    when the accelerator splits or dispatches batches (``split_batches=True``,
    ``dispatch_batches=True``: the loader shards by sample instead; give it
    ``batch_size // num_processes``), or when batches would be numpy arrays that cannot be
    placed on the device (``output="numpy"`` with the default collate)."""
    from shmloader.batch.recipe import user_collate_fn
    from shmloader.loader import DataLoader

    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"prepare() takes a shmloader.DataLoader, got {type(loader).__name__}; give a torch "
            "DataLoader to accelerator.prepare() instead."
        )
    if getattr(accelerator, "split_batches", False) or getattr(accelerator, "dispatch_batches", None):
        raise ValueError(
            "the accelerator splits or dispatches batches (split_batches=True or dispatch_batches=True), "
            "but a shmloader loader loads each rank's own share: build the Accelerator without them and "
            "give the loader batch_size // num_processes for the same global batch."
        )
    if device_placement is None:
        device_placement = bool(getattr(accelerator, "device_placement", True))
    if non_blocking is None:
        non_blocking = bool(getattr(accelerator, "non_blocking", False))
    # (A collate_fn's output is handed out as it returns it, whatever output says: its
    # tensors are placed, and its numpy arrays stay on the host, as under torch's loader.)
    default_collate = not user_collate_fn(loader.collate_fn, loader.config.auto_collation)
    if device_placement and default_collate and getattr(loader, "output", "torch") == "numpy":
        raise ValueError(
            "the loader hands out numpy arrays (output='numpy'), which cannot be placed on "
            f"{accelerator.device}: build it with output='torch' (the default where torch is "
            "imported), or pass device_placement=False."
        )
    if not loader.epoch_settings().sharding_asked and not _presharded(loader):
        loader.distributed = "auto"  # (read when each epoch begins)
    wrapped = AcceleratedLoader(
        accelerator,
        loader,
        device=accelerator.device if device_placement else None,
        non_blocking=non_blocking,
    )
    wrapped.check_sharding()
    if checkpoint:
        accelerator.register_for_checkpointing(wrapped)
    return wrapped


class AcceleratedLoader:
    """A ``shmloader.DataLoader`` under an ``Accelerator`` (made by :func:`prepare`).

    Iterating it iterates the loader (its workers, its ring, its sharding) one batch
    ahead: ``end_of_dataloader`` is True while the epoch's last batch is out, which is
    what ``accelerator.accumulate`` and ``gather_for_metrics`` read through
    ``accelerator.gradient_state``. ``remainder`` is -1: the loader pads a rank's share by
    wrapping around the epoch's order (as ``DistributedSampler``), not at the end of the
    last gathered batch, so ``gather_for_metrics`` keeps those duplicates (drop them by
    sample id, or use ``drop_last=True``).

    ``state_dict()`` is the loader's position after the batches handed out to the
    training loop (not the one looked ahead, also after a loop that broke out);
    ``load_state_dict`` resumes from it on the next ``iter()``. Other attributes
    (``dataset``, ``batch_size``, ``sampler``, ``stats``, ...) are the loader's.
    """

    _is_accelerate_prepared = True  # accelerator.prepare_data_loader() keeps it as it is

    def __init__(self, accelerator: Any, loader: Any, *, device: Any = None, non_blocking: bool = False):
        self.accelerator = accelerator
        self.loader = loader
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state = accelerator.gradient_state
        self.end_of_dataloader = False
        self.remainder = -1
        self._position: dict[str, Any] | None = None  # state after the last batch handed out

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def batch_sampler(self) -> Any:
        """This process's batches of the loader's next epoch (after a loaded position: the
        rest of it), as index lists: what ``accelerator.skip_first_batches`` rebuilds a
        loader over, so it skips into this process's share (the loader's own
        ``batch_sampler`` gives the whole epoch, which Accelerate's ``prepare`` shards).
        None for an iterable dataset."""
        if self.loader.batch_sampler is None:
            return None
        return _ShareBatches(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def total_batch_size(self) -> int:
        """Samples in one step of all processes together (as ``DataLoaderShard``'s)."""
        return int(self.loader.batch_size or 1) * _shard(self.loader)[1]

    @property
    def total_dataset_length(self) -> int:
        """The dataset's length (as ``DataLoaderShard``'s)."""
        return len(self.loader.dataset)

    def check_sharding(self) -> None:
        """Raise ``ValueError`` unless the loader shards by the accelerator's processes."""
        want = (int(self.accelerator.process_index), int(self.accelerator.num_processes))
        have = _shard(self.loader)
        if have != want:
            raise ValueError(
                f"the loader loads as rank {have[0]} of {have[1]} but this accelerator process is "
                f"{want[0]} of {want[1]}: each process would not get its own share. Build the loader "
                "with distributed='auto' (or rank=accelerator.process_index, "
                "world_size=accelerator.num_processes)."
            )

    def __iter__(self) -> Iterator[Any]:
        self.check_sharding()
        self.end_of_dataloader = False
        self._position = None
        self.gradient_state._add_dataloader(self)
        try:
            it = iter(self.loader)
            try:
                current = next(it)
            except StopIteration:
                return
            while True:
                position = self.loader.state_dict()  # `current` handed out, nothing after it
                try:
                    following = next(it)
                except StopIteration:
                    following = None
                    self.end_of_dataloader = True
                self._position = position
                yield self._place(current)
                if self.end_of_dataloader:
                    self._position = None  # the loader's own state: this epoch is done
                    return
                current = following
        finally:
            # A loop that broke out keeps _position: the loader already gave out the batch
            # looked ahead, which the training loop never received.
            self.gradient_state._remove_dataloader(self)

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        from accelerate.utils import send_to_device

        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def state_dict(self) -> dict[str, Any]:
        """The loader's position after the batches the training loop received (mid-epoch
        included), as plain data (``DataLoader.state_dict``)."""
        if self._position is not None:
            return self._position
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state`` on the next ``iter()`` (``DataLoader.load_state_dict``)."""
        self._position = None
        self.loader.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        """Load epoch ``epoch`` on the next ``iter()`` (``DataLoader.set_epoch``)."""
        self._position = None
        self.loader.set_epoch(epoch)


def _presharded(loader: Any) -> Any:
    """The ``DistributedSampler`` that shards ``loader`` (as ``sampler``, or inside its
    ``batch_sampler``), or None."""
    from shmloader.sampling.distributed import is_presharded

    for s in (loader.batch_sampler, loader.sampler):
        if s is not None and is_presharded(s):
            return s if hasattr(s, "num_replicas") else s.sampler
    return None


def _shard(loader: Any) -> tuple[int, int]:
    """``(rank, world size)`` of the share ``loader`` loads: its ``DistributedSampler``'s,
    else the loader's own sharding's."""
    sampler = _presharded(loader)
    if sampler is not None:
        return int(sampler.rank), int(sampler.num_replicas)
    return int(loader.rank), int(loader.world_size)


class _ShareBatches:
    """This process's index lists of ``loader``'s next epoch (see
    ``AcceleratedLoader.batch_sampler``). Iterating it moves what iterating torch's batch
    sampler moves, when it moves it: under torch's RNG the shuffle draws its order at the
    first ``next()``, as the epoch would."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[list[Any]]:
        from shmloader.epoch import state

        runtime = self.loader.runtime
        now = self.loader.epoch_settings().now
        return state.upcoming_batches(runtime.config, runtime.cursor, now)  # (a generator)

    def __len__(self) -> int:
        return len(self.loader)
