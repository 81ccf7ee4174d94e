"""Sharding across ranks: rank / world detection and the split of an epoch's order.

Every rank of a job builds the same global order of an epoch (a function of the loader's
seed and the epoch), removes what an earlier run already consumed, and takes a disjoint
share of the rest, as torch's ``DistributedSampler`` does: rank ``r`` of ``W`` takes
positions ``r, r + W, r + 2W, ...``. Global batch ``k`` (batch ``k`` of every rank) then
covers positions ``[k*W*B, (k+1)*W*B)`` of the remainder, so "how many global samples
were consumed" is one number that any new world size can continue from.

Every rank gets the same number of batches: the remainder is padded to a multiple of
``W`` by wrapping around to the start of the order, or, with ``drop_last``, cut to whole
global batches.

The loader shards so only when asked (``distributed="auto"`` or True, ``rank=``,
``world_size=``). By default it shards as torch's loader does: through a
``DistributedSampler`` the user gives or a framework injects (:func:`is_presharded`), and a
torch DataPipe by torch.distributed's group (:func:`datapipe_shard`); never by the
environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

from shmloader.context import ShardInfo, get_worker_info, main_epoch

__all__ = [
    "ShardInfo",
    "asked",
    "chunks",
    "datapipe_shard",
    "detect",
    "get_shard_info",
    "is_presharded",
    "rank_share",
]


def detect(distributed: Any, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` by which a loader shards its epochs itself.

    ``distributed=False`` (the loader's default, as torch's loader: only a
    ``DistributedSampler`` shards): ``(0, 1)`` unless ``rank``/``world_size`` are given.
    ``"auto"`` (or True): torch.distributed's default group when it is initialized, else the
    ``RANK`` and ``WORLD_SIZE`` environment variables (torchrun sets them), else ``(0, 1)``.
    An explicit ``rank`` or ``world_size`` overrides what was detected."""
    if distributed not in ("auto", True, False):
        raise ValueError(
            f"distributed should be False, 'auto' or True (got {distributed!r}): False (the "
            "default) leaves sharding to a DistributedSampler as torch's loader does; 'auto' "
            "shards across ranks when torch.distributed is initialized or RANK and WORLD_SIZE "
            "are set."
        )
    found_rank, found_world = 0, 1
    if distributed is not False:
        torch = sys.modules.get("torch")
        dist = getattr(torch, "distributed", None) if torch is not None else None
        if dist is not None and dist.is_available() and dist.is_initialized():
            found_rank, found_world = int(dist.get_rank()), int(dist.get_world_size())
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            try:
                found_rank, found_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            except ValueError:
                raise ValueError(
                    f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} "
                    "should be integers; fix the environment or pass rank= and world_size=."
                ) from None
        elif distributed is True:
            raise ValueError(
                "distributed=True but neither torch.distributed is initialized nor RANK and "
                "WORLD_SIZE are set; pass rank= and world_size=, or use distributed='auto'."
            )
    rank = found_rank if rank is None else rank
    world = found_world if world_size is None else world_size
    for name, value in (("rank", rank), ("world_size", world)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} should be an integer (got {value!r}).")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"rank={rank} and world_size={world} are inconsistent: need world_size >= 1 and "
            "0 <= rank < world_size."
        )
    return rank, world


def asked(distributed: Any, rank: int | None, world_size: int | None) -> bool:
    """Whether the user asked the loader to shard by itself: ``distributed`` "auto" or
    True, or an explicit ``rank`` or ``world_size``."""
    return distributed is not False or rank is not None or world_size is not None


def datapipe_shard(distributed: Any, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` a torch DataPipe is sharded by (its ``sharding_filter``):
    the loader's own (:func:`detect`) where sharding was asked for; otherwise torch's
    loader's rule, which shards DataPipes by torch.distributed's default group when it is
    initialized (never by the environment)."""
    if asked(distributed, rank, world_size):
        return detect(distributed, rank, world_size)
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


def is_presharded(sampler: Any) -> bool:
    """True for a sampler that already yields one rank's share (torch's
    ``DistributedSampler``), or a batch sampler over one (Lightning and Fabric inject
    ``BatchSampler(DistributedSampler(...))``): the loader must not shard it again."""
    for s in (sampler, getattr(sampler, "sampler", None)):
        if hasattr(s, "num_replicas") and hasattr(s, "rank"):
            return True
    return False


def rank_share(
    remaining: list[Any], head: Sequence[Any], rank: int, world: int, unit: int, drop_last: bool
) -> list[Any]:
    """Rank ``rank``'s items of ``remaining`` (the rest of an epoch's global order).

    ``unit`` items per rank make one global step (the per-rank batch size, or 1). With
    ``drop_last`` the remainder is cut to whole global steps (``world * unit`` items);
    otherwise it is padded to a multiple of ``world`` with items from ``head`` (the start
    of the epoch's order), wrapping as often as needed."""
    n = len(remaining)
    if drop_last:
        step = world * unit
        remaining = remaining[: n // step * step]
    elif n % world:
        pad = world - n % world
        if not head:
            raise ValueError("cannot pad an empty order")
        reps = -(-pad // len(head))
        remaining = remaining + (list(head) * reps)[:pad]
    return remaining[rank::world]


def chunks(items: Sequence[Any] | Iterator[Any], size: int, drop_last: bool) -> Iterator[list[Any]]:
    """``items`` in lists of ``size``; a final shorter list unless ``drop_last``."""
    it = iter(items)
    if size == 1:  # (batch_size 1: no slicing per batch)
        for item in it:
            yield [item]
        return
    while True:
        chunk = list(islice(it, size))
        if not chunk or (len(chunk) < size and drop_last):
            return
        yield chunk


def get_shard_info() -> ShardInfo:
    """The shard the current code should read, for iterable datasets that split files or
    shards across all workers of all ranks::

        info = shmloader.get_shard_info()
        for path in files[info.shard_id :: info.num_shards]:
            ...

    In a loader worker it comes from the worker info; in the main process it is the loader
    being iterated with ``num_workers=0`` (one shard per rank), else what
    :func:`detect` finds (``(0, 1)`` outside a distributed job)."""
    info = get_worker_info()
    if info is not None:
        return ShardInfo(info.rank, info.world_size, info.id, info.num_workers)
    main = main_epoch()
    if main is not None:
        return main[1]
    rank, world = detect("auto", None, None)
    return ShardInfo(rank, world, 0, 1)
