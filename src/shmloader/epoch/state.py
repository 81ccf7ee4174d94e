"""Epoch plans and exact, elastic resume (``DataLoader.state_dict`` / ``load_state_dict``).

An epoch's global order is a pure function of what was drawn for it (:mod:`shmloader.sampling.draws`:
under torch's RNG the workers' base seed and the order's seed or generator state; under
shmloader's seed scheme the seed and the epoch number), so a loader's position is a
handful of numbers: those, the epoch and how much of the epoch's global order was
consumed (samples, or batches of a user ``batch_sampler``), and the states of the
loader's generators, from which the following epochs draw. A new loader, with any
``num_workers`` and any world size, rebuilds the same order, skips what was consumed
and splits the rest between its ranks (:mod:`shmloader.sampling.distributed`).

Batches that workers prefetched but the consumer had not received are not part of the
state: they are simply produced again after the resume.

Iterable datasets have no global order: each shard (worker of a rank) resumes on its own,
from the dataset's own ``shmloader_state_dict`` when it has one (saved after every batch
the worker produces), or by fast-forwarding past the samples it had delivered.

The state is plain Python data (dicts, lists, ints, strings), safe in a torch checkpoint
(``torch.load(..., weights_only=True)``).

The contract between the pieces: the loader holds a
:class:`~shmloader.sampling.position.Cursor` (its record of where it is between and
within epochs, which only this module moves) and gives each call its
:class:`~shmloader.config.LoaderConfig` (a :class:`Sampling`: what is fixed when it is
made: dataset, samplers, batching) and, where the call reads them, its settings
:class:`~shmloader.sampling.position.Now` (what may change later: the worker count,
rank and world size, ``generator``, ``in_order``); nothing here sees the loader. The
loader's own shuffle is told its epoch's order through its method ``set_next_order``.
The iterator of the running epoch is a :class:`Positioned`: it tells how many batches
it handed out, and per shard how far each one got.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import islice
from typing import Any, Protocol

from shmloader.interop import torchcompat
from shmloader.sampling import distributed as _dist
from shmloader.sampling import draws as _draws
from shmloader.sampling.draws import Draws, SeedSource
from shmloader.sampling.position import Cursor, EpochPlan, Now
from shmloader.sampling.rng import derive_epoch_seed, order_rng
from shmloader.sampling.sampler import SequentialSampler
from shmloader.workers.resume import is_stateful

FORMAT = "shmloader.DataLoader"
VERSION = 1


class Sampling(Protocol):
    """What epoch plans read of a loader's configuration, fixed when the loader is made
    (a :class:`~shmloader.config.LoaderConfig` is one)."""

    @property
    def iterable(self) -> bool:
        """The dataset is iterable-style (no sampler, no global order)."""

    @property
    def dataset(self) -> Any:
        """The dataset."""

    @property
    def sampler(self) -> Any:
        """The sampler the loader iterates (map-style; None for an iterable dataset)."""

    @property
    def batch_sampler(self) -> Any:
        """The batch sampler the loader iterates, or None (no auto-batching)."""

    @property
    def batch_size(self) -> int | None:
        """Samples per batch when the loader batches; None otherwise."""

    @property
    def drop_last(self) -> bool:
        """A final short batch is dropped."""

    @property
    def persistent_workers(self) -> bool:
        """Workers outlive an epoch."""

    @property
    def own_shuffle(self) -> bool:
        """The loader made its RandomSampler: it tells it each epoch's order."""

    @property
    def own_batching(self) -> bool:
        """The loader made its batch sampler: positions count samples, not batches."""


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


def _unit(config: Sampling) -> str:
    if config.iterable:
        return "iterable"
    return "samples" if config.own_batching else "batches"


def _midway(resume: dict[str, Any] | None) -> bool:
    """Whether a loaded position is inside its epoch (some of it already consumed)."""
    if resume is None:
        return False
    workers = resume.get("workers") or []
    return bool(resume.get("consumed")) or any(
        w.get("samples") or w.get("state") is not None for w in workers
    )


def draw_for_iter(config: Sampling, cursor: Cursor, now: Now, new_workers: bool) -> Draws | None:
    """What ``iter(loader)`` draws when torch's RNG decides, as torch's DataLoader draws
    it when it makes (or, persistent, resets) its iterator: a DataPipe's shared seed, the
    workers' base seed (``new_workers``: workers will start; else the running ones keep
    theirs) and, with workers, the loader's own shuffle's order (torch primes its
    prefetch in ``iter()``; in the main process the order is drawn at the first
    ``next()``). A loaded position whose draws were saved draws nothing: it replays them.
    None under the seed scheme (nothing is drawn before the epoch begins)."""
    if not cursor.torch_rng:
        return None
    resume = cursor.resume
    if resume is not None and resume["epoch"] == cursor.next_epoch and resume.get("draws"):
        draws = Draws.from_state(resume["draws"])
    else:
        gen = _torch_generator(now.generator)
        shared = _draws.int64(gen) if _is_iter_datapipe(config.dataset) else None
        if cursor.workers_base is None or (new_workers and not cursor.loaded_base):
            draws = Draws(_draws.int64(gen), shared_seed=shared)
        else:
            draws = Draws(cursor.workers_base, reseed=new_workers, shared_seed=shared)
        cursor.loaded_base = False
        if now.num_workers > 0 and config.own_shuffle:
            draws.order, draws.indices, tail = _draws.draw_order(config.sampler)
            draws.owe(tail, _tail_due(len(draws.indices), config, now))
            draws.pay_due(0)  # torch's sampler ran out while its prefetch was primed
    return draws


def _tail_due(order_len: int, config: Sampling, now: Now) -> int:
    """After how many batches handed out the loader's shuffle makes its last draw
    (:class:`~shmloader.sampling.draws.Tail`) as torch's does: its iterator asks the index
    sampler for index list ``i`` (from 0) as it hands out batch ``i - lead`` (``lead``:
    ``prefetch_factor * num_workers`` lists sent ahead when it is made, none in the main
    process), and the list that finds the shuffle exhausted is number
    ``len(sampler) // batch_size`` (with or without drop_last). ``order_len``: the length
    of the order drawn, which is ``len(sampler)``, read from it rather than from the
    dataset's ``__len__`` again (torch reads it a set number of times an epoch)."""
    exhausting = order_len // (config.batch_size or 1)
    workers = now.num_workers if isinstance(now.num_workers, int) else 0
    lead = now.prefetch_factor * workers if workers > 0 else 0
    return exhausting + 1 - lead


def _torch_generator(gen: Any) -> Any:
    """The loader's ``generator`` where it is a torch Generator, else None (torch's global
    RNG: a loader whose numpy generator resumed a run under torch's RNG)."""
    torch = sys.modules.get("torch")
    return gen if torch is not None and isinstance(gen, torch.Generator) else None


def _is_iter_datapipe(dataset: Any) -> bool:
    from shmloader.interop.torchcompat import is_datapipe

    return is_datapipe(dataset)


def epoch_starter(
    config: Sampling, cursor: Cursor, now: Callable[[], Now], draws: Draws | None = None
) -> Callable[[Positioned], EpochPlan]:
    """What ``iter(loader)`` gives its iterator to call at its first ``next()``:
    ``start(it)`` begins the epoch (:func:`begin_epoch`, with the loader's settings
    ``now()`` read then, and ``draws``: what
    :func:`draw_for_iter` drew for this iterator) and makes ``it`` the iterator
    state_dict() asks. Until then nothing else moved: ``iter()`` starts no worker and
    advances no epoch (and under the seed scheme draws no seed: Lightning calls
    ``iter()`` once more to probe a loader that is not torch's)."""
    given = [draws]

    def start(it: Positioned) -> EpochPlan:
        mine, given[0] = given[0], None  # a second epoch of the iterator (a rollover) draws anew
        plan = begin_epoch(config, cursor, now(), mine)
        cursor.live = weakref.ref(it)
        cursor.pending = None
        return plan

    return start


def begin_epoch(config: Sampling, cursor: Cursor, now: Now, draws: Draws | None = None) -> EpochPlan:
    """Start the loader's next iteration: make the random draws its start makes (under
    torch's RNG, ``draws``: what iter() drew, or drawn now; under the seed scheme a new
    seed where one is due), work out its plan (:func:`plan_epoch`), tell the sampler its
    epoch (``set_epoch``) and read its length, then move the cursor to it (sets
    ``cursor.plan``). The iterators call it at their first ``next()`` (see
    :func:`epoch_starter`)."""
    if cursor.torch_rng:
        if draws is None:  # an epoch begun without its own iter() (a loaded end rolled over)
            gen = _torch_generator(now.generator)
            shared = _draws.int64(gen) if _is_iter_datapipe(config.dataset) else None
            draws = Draws(_draws.int64(gen), shared_seed=shared)
        if _unit(config) == "samples" and config.own_shuffle:
            _order_of(draws, config, now)  # (the main process draws the order now, as torch's)
        seed = None
    else:
        seeds = cursor.seeds
        seed = cursor.seed
        # A numpy generator=: a new seed from it at each epoch (a resume within an epoch
        # keeps the saved one); the order is then a function of that seed alone, so
        # reseeding the generator before an epoch repeats the epoch.
        if (seeds.each_epoch and not _midway(_loaded(cursor))) or seed is None:
            seed = seeds.draw()
    plan = plan_epoch(config, cursor, now, draws, seed)
    if plan.unit != "iterable":
        sampler = _order_source(config, plan.unit)
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(plan.epoch)
        _measure(config, plan, sampler)
        if plan.start and draws is not None and draws.tail is not None:
            draws.tail_due -= plan.start // (plan.step * plan.world_size)  # batches handed out before
    cursor.next_epoch = plan.epoch + 1
    cursor.resume = None
    if cursor.torch_rng:
        cursor.workers_base = plan.epoch_seed
    else:
        cursor.seed = seed
    cursor.plan = plan
    return plan


def _loaded(cursor: Cursor) -> dict[str, Any] | None:
    """The loaded position the cursor's next epoch continues, if any."""
    resume = cursor.resume
    return resume if resume is not None and resume["epoch"] == cursor.next_epoch else None


def _order_source(config: Sampling, unit: str) -> Any:
    """What gives the order of an epoch of ``unit`` (map-style): the sampler, or the
    user's batch sampler."""
    return config.sampler if unit == "samples" else config.batch_sampler


def plan_epoch(
    config: Sampling, cursor: Cursor, now: Now, draws: Draws | None, seed: int | None
) -> EpochPlan:
    """The plan of the cursor's next epoch, worked out and not taken: it moves nothing
    (not the cursor, not the sampler, no RNG). ``draws``: under torch's RNG, what was
    drawn for the epoch (its order drawn already where the loader shuffles); ``seed``:
    under the seed scheme, the seed the epoch derives from. The plan's length
    (``order_len``, ``batches``) is read by the caller once the sampler knows its epoch
    (:func:`_measure`)."""
    epoch = cursor.next_epoch
    resume = _loaded(cursor)
    key = epoch  # what the seed scheme's epoch seeds are derived from, with the seed
    order_key = None
    if draws is not None:
        epoch_seed = draws.base_seed
    else:
        if seed is None:
            raise ValueError("an epoch under the seed scheme is planned from a seed: none was given.")
        seeds = cursor.seeds
        key = 0 if seeds.each_epoch else epoch
        epoch_seed = derive_epoch_seed(seed, key)
        order_key = (seed, key)
    unit = _unit(config)
    presharded = unit != "iterable" and _dist.is_presharded(_order_source(config, unit))
    plan = EpochPlan(
        epoch=epoch,
        epoch_seed=epoch_seed,
        rank=now.rank,
        world_size=1 if presharded else now.world_size,
        unit=unit,
        presharded=presharded,
        draws=draws,
        sample_seed=epoch_seed,
        shared_seed=epoch_seed,
    )
    if draws is not None:
        plan.reseed = draws.reseed
        if draws.shared_seed is not None:
            plan.shared_seed = draws.shared_seed
        if config.persistent_workers:
            # Persistent workers keep torch's base seed across epochs: sample_rng's seed
            # still changes with the epoch.
            plan.sample_seed = derive_epoch_seed(epoch_seed, epoch)
    if unit == "iterable":
        plan.stateful = is_stateful(config.dataset)
        nw = max(now.num_workers, 1)
        if resume is not None:
            plan.workers = [dict(w) for w in resume["workers"]]
            plan.start_worker = int(resume["next_worker"]) % nw
        else:
            plan.workers = [{"samples": 0, "state": None} for _ in range(nw)]
        plan.step = config.batch_size if config.batch_size is not None else 1
    else:
        if unit == "samples":
            plan.step = config.batch_size if config.batch_size is not None else 1
            if config.own_shuffle and draws is None:
                plan.order_key = order_key
        if resume is not None:
            plan.start = int(resume["consumed"])
    plan.resumed = _midway(resume)
    return plan


def _measure(config: Sampling, plan: EpochPlan, sampler: Any) -> None:
    """Read the epoch's length from ``sampler`` (told its epoch already, where it has
    ``set_epoch``) into ``plan``: its order's length and its batches (map-style)."""
    try:
        plan.order_len = len(sampler)
    except TypeError:
        plan.order_len = None
    plan.batches = _batch_count(plan, config.drop_last)


def _order_of(draws: Draws, config: Sampling, now: Now) -> list[int]:
    """The loader's shuffle's order for ``draws``: drawn now where iter() did not draw it
    (the main process draws at the first ``next()``, as torch's), else as drawn, or
    replayed from the record (a resumed epoch, which makes its last draw where the saved
    run would have when that run had not made it yet)."""
    sampler = config.sampler
    if draws.order is None:
        draws.order, draws.indices, tail = _draws.draw_order(sampler)
        draws.owe(tail, _tail_due(len(draws.indices), config, now))
    elif draws.indices is None:
        draws.indices = _draws.replay_order(sampler, draws.order)
        if draws.tail_resumed and sampler.generator is not None:
            # (due as in the saved run: begin_epoch counts what that run had consumed)
            draws.owe(
                _draws.order_tail(sampler, sampler.generator), _tail_due(len(draws.indices), config, now)
            )
    return draws.indices


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


def attach(cursor: Cursor, it: Positioned, draws: Draws | None = None) -> None:
    """``it`` will load the loader's next epoch (``draws``: what iter() drew for it):
    state_dict() asks it for the position."""
    cursor.live = weakref.ref(it)
    cursor.pending = draws


def set_epoch(cursor: Cursor, epoch: int) -> None:
    """The next iteration loads ``epoch``; see ``DataLoader.set_epoch``."""
    if not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch should be a non-negative integer (got {epoch!r}).")
    if cursor.resume is not None and cursor.resume["epoch"] != epoch:
        cursor.resume = None  # moving to another epoch than the loaded one
    cursor.next_epoch = epoch


def upcoming_batches(config: Sampling, cursor: Cursor, now: Now) -> Iterator[list[Any]]:
    """The index lists the loader's next epoch loads (after a loaded position: the rest
    of it), worked out without moving the cursor, for the rank of ``now`` (rank 0 of 1
    gives the whole epoch's batches, as a torch BatchSampler yields them; a rank of
    several, its share). What the loader's own batch
    sampler yields when something else iterates it: a framework that rebuilds a loader
    over ``loader.batch_sampler`` (``accelerate.skip_first_batches``, Accelerate's
    ``BatchSamplerShard``, which shards them itself) then loads the batches this loader
    would. A generator, drawing as iterating torch's batch sampler draws: nothing until
    its first ``next()`` (torch's DataLoader makes two iterators of its batch sampler per
    epoch and advances one), then under torch's RNG the order (a loaded position replays
    its saved draws instead), and the order's last draw when the shuffle runs out; under
    the seed scheme nothing moves (a numpy generator's next seed is peeked at)."""
    batches, owing = _upcoming(config, cursor, now)
    exhausting = len(config.sampler) // (config.batch_size or 1) if owing is not None else -1
    for i, batch in enumerate(batches):
        if i == exhausting and now.world_size == 1:
            owing.pay()  # (the last, short batch finds the shuffle exhausted)
        yield batch
    if owing is not None:
        owing.pay()


def _upcoming(config: Sampling, cursor: Cursor, now: Now) -> tuple[list[list[Any]], Draws | None]:
    """:func:`upcoming_batches`' lists, and the draws whose last draw is still owed. The
    epochs are begun on a scratch copy of the cursor (the loader's own does not move),
    whose seed source draws nothing of the user's."""
    draws: Draws | None = None
    if cursor.torch_rng:
        scratch = replace(cursor)
        resume = cursor.resume
        if resume is not None and resume["epoch"] == cursor.next_epoch and resume.get("draws"):
            draws = Draws.from_state(resume["draws"])
        else:
            draws = Draws(0)  # (no worker is seeded from it)
    else:
        scratch = replace(cursor, seeds=cursor.seeds.detached())  # type: ignore[union-attr]
    plan = begin_epoch(config, scratch, now, draws)
    batches = list(index_sequence(config, plan))
    if not batches and plan.resumed:  # a loaded position at its epoch's end: the next one
        if draws is not None:
            draws.pay()
        draws = Draws(0) if cursor.torch_rng else None
        plan = begin_epoch(config, scratch, now, draws)
        batches = list(index_sequence(config, plan))
    return batches, draws if draws is not None and draws.tail is not None else None


def plan_ahead(config: Sampling, cursor: Cursor, now: Now) -> tuple[EpochPlan, Iterator[list[Any]]] | None:
    """The plan and tasks of the loader's next epoch, worked out now without moving the
    cursor or telling the sampler anything (:func:`plan_epoch`), where they are a
    function of the seed and the epoch alone: a map-style dataset, batched by the
    loader, its order the loader's shuffle or a ``SequentialSampler`` with no
    ``set_epoch`` (an order that may depend on the epoch it is told is known only once
    it is told), shmloader's seed scheme without a generator (torch's RNG and a
    generator are drawn from when the epoch begins: a user who reseeds them before
    ``iter()`` must get that epoch), a seed drawn already and no loaded position. None
    elsewhere. The epoch's real plan, when it begins, must equal this one for the tasks
    to be used (``set_epoch``, a changed dataset length or world size make it differ);
    the tasks iterate the sampler for that epoch now, so the epoch that takes them over
    iterates it no more."""
    if (
        config.iterable
        or cursor.torch_rng
        or cursor.seeds.each_epoch  # type: ignore[union-attr]
        or cursor.seed is None
        or not config.own_batching
        or cursor.resume is not None
    ):
        return None
    sampler = config.sampler
    if not config.own_shuffle and not isinstance(sampler, SequentialSampler):
        return None
    if callable(getattr(sampler, "set_epoch", None)):
        return None
    plan = plan_epoch(config, cursor, now, None, cursor.seed)
    _measure(config, plan, sampler)
    return plan, index_sequence(config, plan)


def _sampler_iter(sampler: Any, order_len: int | None) -> Iterator[Any]:
    """``iter(sampler)``; for a sequential sampler (shmloader's or torch's, methods not
    overridden), whose order is ``range(len(dataset))``, the range of the length the
    epoch's plan just read: the dataset's ``__len__`` is called once per epoch, as torch's
    loader calls it."""
    cls = type(sampler)
    if order_len is not None:
        for base in (SequentialSampler, torchcompat.torch_class("SequentialSampler")):
            if base is not None and cls.__iter__ is base.__iter__ and cls.__len__ is base.__len__:
                return iter(range(order_len))
    return iter(sampler)


def index_sequence(config: Sampling, plan: EpochPlan) -> Iterator[list[Any]]:
    """This rank's tasks of the iteration: lists of sample keys, one per batch."""
    drop_last = config.drop_last
    if plan.unit == "batches":
        source = iter(config.batch_sampler)
        if plan.world_size == 1:
            return islice(source, plan.start, None)
        order = list(source)
        rest = order[plan.start :]
        return iter(_dist.rank_share(rest, order, plan.rank, plan.world_size, 1, False) if rest else [])
    if config.own_shuffle and plan.unit == "samples":
        # The loader's shuffle is told the epoch's order right before it is iterated for
        # it (its next iter() only): nothing is left set for another iter().
        if plan.draws is not None:
            config.sampler.set_next_order(indices=plan.draws.indices)
        elif plan.order_key is not None:
            config.sampler.set_next_order(rng=order_rng(*plan.order_key))
    if plan.world_size == 1:
        source = _sampler_iter(config.sampler, plan.order_len)
        if plan.start:
            next(islice(source, plan.start, plan.start), None)  # skip what was consumed
        return _dist.chunks(source, plan.step, drop_last)
    order = list(config.sampler)
    rest = order[plan.start :]
    if not rest:
        return iter(())
    mine = _dist.rank_share(rest, order, plan.rank, plan.world_size, plan.step, drop_last)
    return _dist.chunks(mine, plan.step, False)


def sharded_len(config: Sampling, world: int) -> int:
    """Batches one rank of ``world`` gets in a whole epoch (map-style, world > 1)."""
    if config.own_batching:
        n = len(config.sampler)
        size = config.batch_size if config.batch_size is not None else 1
        if config.drop_last:
            return n // (world * size)
        per_rank = -(-n // world)  # padded to a multiple of the world size
        return -(-per_rank // size)
    return -(-len(config.batch_sampler) // world)


# --- saving -----------------------------------------------------------------------------


def state_dict(config: Sampling, cursor: Cursor, now: Now, workers_kept: bool) -> dict[str, Any]:
    """The loader's position; see ``DataLoader.state_dict``. ``workers_kept``: the loader
    keeps running persistent workers for its next epoch."""
    base = {
        "format": FORMAT,
        "version": VERSION,
        "rng": "torch" if cursor.torch_rng else "seed",
        "seed": None if cursor.seed is None else int(cursor.seed),
        "generators": _generator_states(config, cursor, now.generator),
        "unit": _unit(config),
        "rank": now.rank,
        "world_size": now.world_size,
        "num_workers": now.num_workers,
        "batch_size": config.batch_size,
        "dataset_len": _dataset_len(config.dataset),
    }
    it: Positioned | None = cursor.live() if cursor.live is not None else None
    plan = cursor.plan
    # No epoch running (none yet, or iter() called but no next() yet: nothing moved), or
    # the running one handed out its last batch (StopIteration may not have been raised:
    # Lightning saves at that step): the position is the start of the next epoch.
    if it is None or plan is None or it.plan is not plan or it.epoch_done or _finished(it, plan):
        if cursor.resume is not None:  # loaded, not iterated yet: the loaded position
            position = {**base, **cursor.resume}
        else:
            position = {**base, **_fresh_position(config, cursor, now)}
        if it is not None and it.plan is None and cursor.pending is not None:
            # iter() drew for the epoch it will begin (torch's RNG): a resume replays that.
            position["draws"] = cursor.pending.to_state()
        elif cursor.torch_rng and cursor.workers_base is not None and (cursor.loaded_base or workers_kept):
            # Persistent workers draw their base seed once: the next epoch draws none.
            position["workers_base"] = cursor.workers_base
        return position
    if not now.in_order:
        raise ValueError(
            "state_dict() needs in_order=True: with in_order=False the batches handed out "
            "so far are not a prefix of the epoch, so no position describes them."
        )
    if plan.draws is not None:
        base["draws"] = plan.draws.to_state()
    if plan.unit == "iterable":
        return {**base, "epoch": plan.epoch, **_iterable_position(it, plan)}
    handed = it.handed_out()
    consumed = plan.start + handed * plan.world_size * plan.step
    if plan.order_len is not None:
        consumed = min(consumed, plan.order_len)
    return {**base, "epoch": plan.epoch, "consumed": consumed, "presharded": plan.presharded}


def _generator_states(config: Sampling, cursor: Cursor, gen: Any) -> dict[str, Any]:
    """The states of the generators the following epochs draw from, as plain data: under
    torch's RNG the loader's ``generator`` and, where a framework gave the shuffle another
    one (Accelerate does), the sampler's; under the seed scheme a numpy ``generator``.
    torch's global RNG is the program's, not the loader's: it is not saved."""
    if not cursor.torch_rng:
        state = cursor.seeds.generator_state()  # type: ignore[union-attr]
        return {} if state is None else {"numpy": state}
    torch = sys.modules["torch"]
    out: dict[str, Any] = {}
    if isinstance(gen, torch.Generator):
        out["loader"] = _draws.generator_state(gen)
    own = getattr(config.sampler, "generator", None) if config.own_shuffle else None
    if isinstance(own, torch.Generator) and own is not gen:
        out["sampler"] = _draws.generator_state(own)
    return out


def _finished(it: Positioned, plan: EpochPlan) -> bool:
    """Whether ``it`` handed out every batch of its epoch."""
    if plan.unit == "iterable":
        return it.shards_exhausted()
    return plan.batches is not None and it.handed_out() >= plan.batches


def _dataset_len(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _fresh_position(config: Sampling, cursor: Cursor, now: Now) -> dict[str, Any]:
    epoch = cursor.next_epoch
    if config.iterable:
        nw = max(now.num_workers, 1)
        return {
            "epoch": epoch,
            "workers": [{"samples": 0, "state": None} for _ in range(nw)],
            "next_worker": 0,
        }
    sampler = config.sampler if config.own_batching else config.batch_sampler
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


def load_state_dict(
    config: Sampling, cursor: Cursor, now: Now, state: dict[str, Any], stop_workers: Callable[[], None]
) -> None:
    """Make the loader's next iteration continue from ``state``; see
    ``DataLoader.load_state_dict``. ``stop_workers`` stops the loader's persistent
    workers: called once ``state`` is found loadable (they start afresh from it)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(
            "load_state_dict expects a dict made by shmloader's DataLoader.state_dict() "
            f"(got {type(state).__name__} without format={FORMAT!r})."
        )
    if state.get("version") != VERSION:
        raise ValueError(
            f"loader state version {state.get('version')!r} is not supported (expected {VERSION})."
        )
    unit = _unit(config)
    if state["unit"] != unit:
        raise ValueError(
            f"this state was saved by a loader over {state['unit']} and this loader iterates "
            f"{unit}: load it into a loader built like the saved one (same dataset kind, and "
            "batch_sampler given or not in both)."
        )
    n = _dataset_len(config.dataset)
    if state.get("dataset_len") is not None and n is not None and n != state["dataset_len"]:
        raise ValueError(
            f"this state was saved with a dataset of {state['dataset_len']} samples, this "
            f"loader's has {n}: the epoch's order would differ, so the resume cannot be exact."
        )
    resume = {
        k: state[k]
        for k in ("epoch", "consumed", "presharded", "workers", "next_worker", "draws")
        if k in state
    }
    if unit == "iterable":
        _check_iterable(now, state)
        if not is_stateful(config.dataset):
            skipped = sum(w["samples"] for w in state["workers"])
            if skipped:
                warnings.warn(
                    f"{type(config.dataset).__name__} has no shmloader_state_dict()/"
                    f"shmloader_load_state_dict(): resuming by fast-forwarding {skipped} samples "
                    "(the workers read them again and drop them). Give the dataset those two "
                    f"methods to resume without rereading.{stateful_hint(config.dataset)}",
                    stacklevel=3,
                )
    elif state.get("presharded") and state["world_size"] != now.world_size:
        raise ValueError(
            "this state was saved with a sampler that shards by itself (DistributedSampler) "
            f"over {state['world_size']} ranks; it cannot be re-split over {now.world_size}. "
            "Let shmloader shard (drop the DistributedSampler) to resume with another world size."
        )
    # The loader adopts the saved run's scheme (torch's RNG, or a seed) and puts its
    # generators where they were, so this epoch and the following ones draw as that run's.
    torch_rng = state.get("rng", "seed") == "torch"
    _set_generator_states(config, cursor, now.generator, state.get("generators") or {}, torch_rng)
    stop_workers()  # persistent workers start afresh, from the loaded position
    seed = state.get("seed")
    if torch_rng:
        cursor.seeds = None
    elif cursor.seeds is None:  # a loader under torch's RNG resumes a seeded run: that seed
        cursor.seeds = SeedSource.of_seed(int(seed)) if seed is not None else SeedSource()
    cursor.seed = None if seed is None else int(seed)
    cursor.next_epoch = int(state["epoch"])
    cursor.resume = resume
    cursor.live = None
    cursor.pending = None
    base = state.get("workers_base")
    cursor.workers_base = int(base) if torch_rng and base is not None else None
    cursor.loaded_base = cursor.workers_base is not None


def _set_generator_states(
    config: Sampling, cursor: Cursor, generator: Any, states: dict[str, Any], torch_rng: bool
) -> None:
    """Put the loader's generators (``generator``, and its sampler's) where a saved
    state's ``generators`` say."""
    if "numpy" in states and cursor.seeds is not None and cursor.seeds.generator is not None:
        cursor.seeds.set_generator_state(states["numpy"])
    if not torch_rng or not (states.get("loader") or states.get("sampler")):
        return
    torch = sys.modules["torch"]
    for key, gen in (("loader", generator), ("sampler", getattr(config.sampler, "generator", None))):
        if states.get(key) is None:
            continue
        if isinstance(gen, torch.Generator):
            _draws.set_generator_state(gen, states[key])
        else:
            warnings.warn(
                f"this state holds the state of the {key}'s torch.Generator, and this loader's "
                f"{key} has none: the epochs after the resumed one draw from torch's global RNG "
                "instead of the saved run's generator. Build the loader with generator= as the "
                "saved run was.",
                stacklevel=4,
            )


def _check_iterable(settings: Now, state: dict[str, Any]) -> None:
    saved = (state["rank"], state["world_size"], max(state["num_workers"], 1))
    now = (settings.rank, settings.world_size, max(settings.num_workers, 1))
    if saved != now:
        raise ValueError(
            "an iterable dataset resumes shard by shard, and this state was saved by rank "
            f"{saved[0]} of {saved[1]} with {saved[2]} worker(s) per rank; this loader is rank "
            f"{now[0]} of {now[1]} with {now[2]}. Resume with the same rank, world size and "
            "num_workers (each shard's dataset copy splits its data by those numbers)."
        )


def worker_resume(plan: EpochPlan | None, wid: int) -> dict[str, Any] | None:
    """What worker ``wid`` resumes from in ``plan``'s epoch (None: from the start)."""
    if plan is None or plan.workers is None:
        return None
    record = plan.workers[wid]
    if not record.get("samples") and record.get("state") is None:
        return None
    return record
