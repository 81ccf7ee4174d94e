"""Epoch plans and exact, elastic resume (``DataLoader.state_dict`` / ``load_state_dict``).

An epoch's global order is a pure function of the loader's seed and the epoch number, so
a loader's position is a handful of numbers: the seed, the epoch and how much of the
epoch's global order was consumed (samples, or batches of a user ``batch_sampler``). A
new loader, with any ``num_workers`` and any world size, rebuilds the same order, skips
what was consumed and splits the rest between its ranks (:mod:`shmloader.distributed`).

Batches that workers prefetched but the consumer had not received are not part of the
state: they are simply produced again after the resume.

Iterable datasets have no global order: each shard (worker of a rank) resumes on its own,
from the dataset's own ``shmloader_state_dict`` when it has one (saved after every batch
the worker produces), or by fast-forwarding past the samples it had delivered.

The state is plain Python data (dicts, lists, ints, strings), safe in a torch checkpoint
(``torch.load(..., weights_only=True)``).

The contract between the pieces: the loader holds a :class:`Cursor` (this module's
record of where it is between and within epochs: nothing here reads the loader's private
fields), and the iterator of the running epoch is a :class:`Positioned`: it tells how
many batches it handed out, and per shard how far each one got.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from itertools import islice
from typing import Any, Protocol

from shmloader import distributed as _dist
from shmloader.rng import derive_epoch_seed, order_rng

FORMAT = "shmloader.DataLoader"
VERSION = 1


@dataclass
class EpochPlan:
    """What one iteration of a loader loads: decided by :func:`begin_epoch`."""

    epoch: int
    epoch_seed: int
    rank: int
    world_size: int
    unit: str  # "samples", "batches" (user batch_sampler) or "iterable"
    start: int = 0  # units of the global order consumed before this iteration began
    step: int = 1  # units one batch of one rank covers: the per-rank batch size, or 1
    order_len: int | None = None  # length of the epoch's global order, when known
    presharded: bool = False  # the sampler already yields one rank's share
    # Iterable datasets: one record per local worker {"samples": n, "state": obj or None}
    # as loaded, and the worker the first batch comes from.
    workers: list[dict[str, Any]] | None = None
    start_worker: int = 0
    stateful: bool = False  # the iterable dataset has shmloader_state_dict / shmloader_load_state_dict
    shard_states: dict[int, Any] = field(default_factory=dict)
    # It continues a loaded position from inside its epoch: when that position was the
    # epoch's end (nothing left), the iterator begins the next epoch instead.
    resumed: bool = False
    batches: int | None = None  # batches this iteration yields (map-style, length known)


@dataclass
class Cursor:
    """Where a loader is between and within epochs (the loader holds one; only this
    module reads or moves it). Every epoch's order and worker seeds are functions of
    ``seed`` and the epoch; with a ``generator=``, ``seed`` is drawn again from it at each
    epoch (``draw_seed``), as torch draws its order and base seed, so reseeding the
    generator before an epoch repeats it."""

    seed: int
    draw_seed: Callable[[], int]
    reseed_each_epoch: bool
    own_shuffle: bool  # the loader made the RandomSampler: its order is seeded from here
    own_batching: bool  # the loader made the BatchSampler: positions count samples
    next_epoch: int = 0  # the epoch the next iter() loads (set_epoch, or one more)
    resume: dict[str, Any] | None = None  # a loaded position, for the next iter()
    plan: EpochPlan | None = None  # the running (or last) epoch
    live: weakref.ref | None = None  # its iterator (or a pending one), which state_dict() asks


class Positioned(Protocol):
    """What an epoch's iterator tells :func:`state_dict`."""

    plan: EpochPlan | None  # the epoch it loads; None until its first next() began it
    epoch_done: bool  # it raised StopIteration

    def handed_out(self) -> int:
        """Batches handed out (or raised) so far this epoch."""

    def shard_positions(self) -> tuple[list[int], int, dict[int, Any]]:
        """Iterable datasets: per local worker the batches handed out, the worker the
        next batch comes from, and the dataset states (``shmloader_state_dict()``) after each
        worker's last handed-out batch, where the dataset has them."""

    def shards_exhausted(self) -> bool:
        """Iterable datasets: every shard is known to have run out and everything it
        produced was handed out (the next ``next()`` raises StopIteration)."""


def is_stateful(dataset: Any) -> bool:
    """Whether an iterable dataset saves and restores its own position for the loader:
    ``shmloader_state_dict`` and ``shmloader_load_state_dict`` (never a ``state_dict`` the
    dataset has for itself: torch's loader calls none)."""
    return callable(getattr(dataset, "shmloader_state_dict", None)) and callable(
        getattr(dataset, "shmloader_load_state_dict", None)
    )


def stateful_hint(dataset: Any) -> str:
    """A sentence for a dataset that has ``state_dict``/``load_state_dict`` but not the
    loader's pair (the loader does not call those), else ''."""
    if is_stateful(dataset) or not callable(getattr(dataset, "state_dict", None)):
        return ""
    return (
        f" ({type(dataset).__name__} has state_dict(), which the loader never calls, as torch's "
        "does not: name the pair shmloader_state_dict()/shmloader_load_state_dict(), or add "
        "those two calling yours.)"
    )


def _unit(loader: Any, cursor: Cursor) -> str:
    if loader.iterable:
        return "iterable"
    return "samples" if cursor.own_batching else "batches"


def _midway(resume: dict[str, Any] | None) -> bool:
    """Whether a loaded position is inside its epoch (some of it already consumed)."""
    if resume is None:
        return False
    workers = resume.get("workers") or []
    return bool(resume.get("consumed")) or any(
        w.get("samples") or w.get("state") is not None for w in workers
    )


def epoch_starter(loader: Any, cursor: Cursor) -> Callable[[Positioned], EpochPlan]:
    """What ``iter(loader)`` gives its iterator to call at its first ``next()``:
    ``start(it)`` begins the epoch (:func:`begin_epoch`) and makes ``it`` the iterator
    state_dict() asks. Until then nothing moved: ``iter()`` alone starts no worker,
    advances no epoch and draws no seed (Lightning calls ``iter()`` once more to probe)."""

    def start(it: Positioned) -> EpochPlan:
        plan = begin_epoch(loader, cursor)
        cursor.live = weakref.ref(it)
        return plan

    return start


def begin_epoch(loader: Any, cursor: Cursor) -> EpochPlan:
    """Start the next iteration of ``loader``: pick its epoch (``set_epoch``, or one more
    than the last), apply a loaded state, seed the epoch's order. Sets ``cursor.plan``.
    The iterators call it at their first ``next()`` (see :func:`epoch_starter`)."""
    epoch = cursor.next_epoch
    cursor.next_epoch = epoch + 1
    resume = cursor.resume if cursor.resume is not None and cursor.resume["epoch"] == epoch else None
    cursor.resume = None
    # generator=: a new seed from it at each iter(), as torch draws its order and base seed
    # (a resume within an epoch keeps the saved one); the order is then a function of that
    # seed alone, so reseeding the generator before an epoch repeats the epoch.
    reseed = cursor.reseed_each_epoch
    if reseed and not _midway(resume):
        cursor.seed = cursor.draw_seed()
    seed = cursor.seed
    key = 0 if reseed else epoch  # what the epoch's seeds are derived from, with the seed
    unit = _unit(loader, cursor)
    sampler = loader.sampler if unit == "samples" else loader.batch_sampler
    presharded = unit != "iterable" and _dist.is_presharded(sampler)
    plan = EpochPlan(
        epoch=epoch,
        epoch_seed=derive_epoch_seed(seed, key),
        rank=loader.rank,
        world_size=1 if presharded else loader.world_size,
        unit=unit,
        presharded=presharded,
    )
    if unit == "iterable":
        plan.stateful = is_stateful(loader.dataset)
        nw = max(loader.num_workers, 1)
        if resume is not None:
            plan.workers = [dict(w) for w in resume["workers"]]
            plan.start_worker = int(resume["next_worker"]) % nw
        else:
            plan.workers = [{"samples": 0, "state": None} for _ in range(nw)]
        plan.step = loader.batch_size if loader.batch_size is not None else 1
    else:
        if unit == "samples":
            plan.step = loader.batch_size if loader.batch_size is not None else 1
            if cursor.own_shuffle:
                sampler._epoch_rng = order_rng(seed, key)
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        try:
            plan.order_len = len(sampler)
        except TypeError:
            plan.order_len = None
        if resume is not None:
            plan.start = int(resume["consumed"])
        plan.batches = _batch_count(plan, loader.drop_last)
    plan.resumed = _midway(resume)
    cursor.plan = plan
    return plan


def _batch_count(plan: EpochPlan, drop_last: bool) -> int | None:
    """Batches :func:`index_sequence` yields for ``plan`` (map-style), None when the
    sampler has no length."""
    if plan.order_len is None:
        return None
    rest = max(plan.order_len - plan.start, 0)
    world, step = plan.world_size, plan.step
    if plan.unit == "batches":
        return -(-rest // world)
    if world == 1:
        return rest // step if drop_last else -(-rest // step)
    if drop_last:
        return rest // (world * step)
    per_rank = -(-rest // world)  # padded to a multiple of the world size
    return -(-per_rank // step)


def attach(cursor: Cursor, it: Positioned) -> None:
    """``it`` loads ``cursor``'s running epoch: state_dict() asks it for the position."""
    cursor.live = weakref.ref(it)


def set_epoch(cursor: Cursor, epoch: int) -> None:
    """The next iteration loads ``epoch``; see ``DataLoader.set_epoch``."""
    if not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch should be a non-negative integer (got {epoch!r}).")
    if cursor.resume is not None and cursor.resume["epoch"] != epoch:
        cursor.resume = None  # moving to another epoch than the loaded one
    cursor.next_epoch = epoch


def upcoming_batches(loader: Any, cursor: Cursor) -> list[list[Any]]:
    """The index lists ``loader``'s next epoch loads (after a loaded position: the rest
    of it), worked out without moving the cursor; ``loader`` is any object with the
    loader's sampling attributes (rank 0 of 1 gives the whole epoch's batches, as a torch
    BatchSampler yields them). What the loader's own batch sampler yields when something
    else iterates it: a framework that rebuilds a loader over ``loader.batch_sampler``
    (``accelerate.skip_first_batches``, Accelerate's ``BatchSamplerShard``, which shards
    them itself) then loads the batches this loader would. With ``generator=`` the next
    epoch's seed is drawn only when that epoch begins, so the current seed stands in."""
    saved = {f.name: getattr(cursor, f.name) for f in fields(cursor)}
    cursor.draw_seed = lambda: cursor.seed
    try:
        plan = begin_epoch(loader, cursor)
        batches = list(index_sequence(loader, plan))
        if not batches and plan.resumed:  # a loaded position at its epoch's end: the next one
            batches = list(index_sequence(loader, begin_epoch(loader, cursor)))
        return batches
    finally:
        for name, value in saved.items():
            setattr(cursor, name, value)


def plan_ahead(loader: Any, cursor: Cursor) -> tuple[EpochPlan, Iterator[list[Any]]] | None:
    """The plan and tasks of ``loader``'s next epoch, worked out now without moving the
    cursor, where they are a function of the seed and the epoch alone: a map-style
    dataset, batched by the loader, its order the loader's shuffle or a
    ``SequentialSampler``, no ``generator=`` (drawn from when the epoch begins: a user
    who reseeds it before ``iter()`` must get that epoch) and no loaded position. None
    elsewhere. The epoch's real plan, when it begins, must equal this one for the tasks
    to be used (``set_epoch``, a changed dataset length or world size make it differ)."""
    from shmloader.sampler import SequentialSampler

    if loader.iterable or cursor.reseed_each_epoch or not cursor.own_batching or cursor.resume is not None:
        return None
    if not cursor.own_shuffle and not isinstance(loader.sampler, SequentialSampler):
        return None
    saved = {f.name: getattr(cursor, f.name) for f in fields(cursor)}
    try:
        plan = begin_epoch(loader, cursor)
        return plan, index_sequence(loader, plan)
    finally:
        for name, value in saved.items():
            setattr(cursor, name, value)


def took_ahead(loader: Any, cursor: Cursor) -> None:
    """The epoch that began took over the tasks :func:`plan_ahead` made: the order
    :func:`begin_epoch` seeded for it was drawn then, so the loader's shuffle forgets
    the seed it just got (a later ``iter(loader.sampler)`` draws afresh, as ever)."""
    if cursor.own_shuffle:
        loader.sampler._epoch_rng = None


def index_sequence(loader: Any, plan: EpochPlan) -> Iterator[list[Any]]:
    """This rank's tasks of the iteration: lists of sample keys, one per batch."""
    drop_last = loader.drop_last
    if plan.unit == "batches":
        source = iter(loader.batch_sampler)
        if plan.world_size == 1:
            return islice(source, plan.start, None)
        order = list(source)
        rest = order[plan.start :]
        return iter(_dist.rank_share(rest, order, plan.rank, plan.world_size, 1, False) if rest else [])
    if plan.world_size == 1:
        source = iter(loader.sampler)
        if plan.start:
            next(islice(source, plan.start, plan.start), None)  # skip what was consumed
        return _dist.chunks(source, plan.step, drop_last)
    order = list(loader.sampler)
    rest = order[plan.start :]
    if not rest:
        return iter(())
    mine = _dist.rank_share(rest, order, plan.rank, plan.world_size, plan.step, drop_last)
    return _dist.chunks(mine, plan.step, False)


def sharded_len(loader: Any, cursor: Cursor) -> int:
    """Batches one rank gets in a whole epoch (map-style, world_size > 1)."""
    world = loader.world_size
    if cursor.own_batching:
        n = len(loader.sampler)
        size = loader.batch_size if loader.batch_size is not None else 1
        if loader.drop_last:
            return n // (world * size)
        per_rank = -(-n // world)  # padded to a multiple of the world size
        return -(-per_rank // size)
    return -(-len(loader.batch_sampler) // world)


# --- saving -----------------------------------------------------------------------------


def state_dict(loader: Any, cursor: Cursor) -> dict[str, Any]:
    """The loader's position; see ``DataLoader.state_dict``."""
    base = {
        "format": FORMAT,
        "version": VERSION,
        "seed": int(cursor.seed),
        "unit": _unit(loader, cursor),
        "rank": loader.rank,
        "world_size": loader.world_size,
        "num_workers": loader.num_workers,
        "batch_size": loader.batch_size,
        "dataset_len": _dataset_len(loader),
    }
    it: Positioned | None = cursor.live() if cursor.live is not None else None
    plan = cursor.plan
    # No epoch running (none yet, or iter() called but no next() yet: nothing moved), or
    # the running one handed out its last batch (StopIteration may not have been raised:
    # Lightning saves at that step): the position is the start of the next epoch.
    if it is None or plan is None or it.plan is not plan or it.epoch_done or _finished(it, plan):
        if cursor.resume is not None:  # loaded, not iterated yet: the loaded position
            return {**base, **cursor.resume}
        return {**base, **_fresh_position(loader, cursor)}
    if not loader.in_order:
        raise ValueError(
            "state_dict() needs in_order=True: with in_order=False the batches handed out "
            "so far are not a prefix of the epoch, so no position describes them."
        )
    if plan.unit == "iterable":
        return {**base, "epoch": plan.epoch, **_iterable_position(it, plan)}
    handed = it.handed_out()
    consumed = plan.start + handed * plan.world_size * plan.step
    if plan.order_len is not None:
        consumed = min(consumed, plan.order_len)
    return {**base, "epoch": plan.epoch, "consumed": consumed, "presharded": plan.presharded}


def _finished(it: Positioned, plan: EpochPlan) -> bool:
    """Whether ``it`` handed out every batch of its epoch."""
    if plan.unit == "iterable":
        return it.shards_exhausted()
    return plan.batches is not None and it.handed_out() >= plan.batches


def _dataset_len(loader: Any) -> int | None:
    try:
        return len(loader.dataset)
    except TypeError:
        return None


def _fresh_position(loader: Any, cursor: Cursor) -> dict[str, Any]:
    epoch = cursor.next_epoch
    if loader.iterable:
        nw = max(loader.num_workers, 1)
        return {
            "epoch": epoch,
            "workers": [{"samples": 0, "state": None} for _ in range(nw)],
            "next_worker": 0,
        }
    sampler = loader.sampler if cursor.own_batching else loader.batch_sampler
    return {"epoch": epoch, "consumed": 0, "presharded": _dist.is_presharded(sampler)}


def _iterable_position(it: Positioned, plan: EpochPlan) -> dict[str, Any]:
    workers = [dict(w) for w in plan.workers]  # type: ignore[union-attr]
    counts, next_worker, states = it.shard_positions()
    for wid, n in enumerate(counts):
        workers[wid]["samples"] += n * plan.step
    for wid, state in states.items():
        workers[wid]["state"] = state
    return {"workers": workers, "next_worker": next_worker}


# --- loading ----------------------------------------------------------------------------


def load_state_dict(loader: Any, cursor: Cursor, state: dict[str, Any]) -> None:
    """Make the loader's next iteration continue from ``state``; see
    ``DataLoader.load_state_dict``."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(
            "load_state_dict expects a dict made by shmloader's DataLoader.state_dict() "
            f"(got {type(state).__name__} without format={FORMAT!r})."
        )
    if state.get("version") != VERSION:
        raise ValueError(
            f"loader state version {state.get('version')!r} is not supported (expected {VERSION})."
        )
    unit = _unit(loader, cursor)
    if state["unit"] != unit:
        raise ValueError(
            f"this state was saved by a loader over {state['unit']} and this loader iterates "
            f"{unit}: load it into a loader built like the saved one (same dataset kind, and "
            "batch_sampler given or not in both)."
        )
    n = _dataset_len(loader)
    if state.get("dataset_len") is not None and n is not None and n != state["dataset_len"]:
        raise ValueError(
            f"this state was saved with a dataset of {state['dataset_len']} samples, this "
            f"loader's has {n}: the epoch's order would differ, so the resume cannot be exact."
        )
    resume = {
        k: state[k] for k in ("epoch", "consumed", "presharded", "workers", "next_worker") if k in state
    }
    if unit == "iterable":
        _check_iterable(loader, state)
        if not is_stateful(loader.dataset):
            skipped = sum(w["samples"] for w in state["workers"])
            if skipped:
                warnings.warn(
                    f"{type(loader.dataset).__name__} has no shmloader_state_dict()/"
                    f"shmloader_load_state_dict(): resuming by fast-forwarding {skipped} samples "
                    "(the workers read them again and drop them). Give the dataset those two "
                    f"methods to resume without rereading.{stateful_hint(loader.dataset)}",
                    stacklevel=3,
                )
    elif state.get("presharded") and state["world_size"] != loader.world_size:
        raise ValueError(
            "this state was saved with a sampler that shards by itself (DistributedSampler) "
            f"over {state['world_size']} ranks; it cannot be re-split over {loader.world_size}. "
            "Let shmloader shard (drop the DistributedSampler) to resume with another world size."
        )
    loader.shutdown()  # persistent workers start afresh, from the loaded position
    cursor.seed = int(state["seed"])
    cursor.next_epoch = int(state["epoch"])
    cursor.resume = resume
    cursor.live = None


def _check_iterable(loader: Any, state: dict[str, Any]) -> None:
    saved = (state["rank"], state["world_size"], max(state["num_workers"], 1))
    now = (loader.rank, loader.world_size, max(loader.num_workers, 1))
    if saved != now:
        raise ValueError(
            "an iterable dataset resumes shard by shard, and this state was saved by rank "
            f"{saved[0]} of {saved[1]} with {saved[2]} worker(s) per rank; this loader is rank "
            f"{now[0]} of {now[1]} with {now[2]}. Resume with the same rank, world size and "
            "num_workers (each shard's dataset copy splits its data by those numbers)."
        )


def open_iterable(dataset: Any, record: dict[str, Any] | None) -> Iterator[Any]:
    """``iter(dataset)`` positioned where ``record`` (a worker's saved record) left it:
    the dataset's own state is loaded first when saved, else the delivered samples are
    skipped."""
    if record is not None and record.get("state") is not None and is_stateful(dataset):
        dataset.shmloader_load_state_dict(record["state"])
        return iter(dataset)
    it = iter(dataset)
    skip = int(record["samples"]) if record is not None else 0
    if skip:
        next(islice(it, skip, skip), None)
    return it


def worker_resume(plan: EpochPlan | None, wid: int) -> dict[str, Any] | None:
    """What worker ``wid`` resumes from in ``plan``'s epoch (None: from the start)."""
    if plan is None or plan.workers is None:
        return None
    record = plan.workers[wid]
    if not record.get("samples") and record.get("state") is None:
        return None
    return record
