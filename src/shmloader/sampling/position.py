"""Where a loader is: the records epoch plans read and write (:mod:`shmloader.epoch.state`
moves them; the loader's working parts hold them).

:class:`Now` is a loader's settings of the moment, read for one call; :class:`EpochPlan`
is what one iteration loads; :class:`Cursor` is where the loader is between and within
epochs. Plain records: nothing here draws, plans or sees the loader.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from shmloader.sampling.draws import Draws, SeedSource


@dataclass(frozen=True)
class Now:
    """A loader's settings that may change after it was made, as read for one call: the
    worker count in use (``"auto"``, or torch's writable ``num_workers``), the rank and
    world size it shards by (read at each epoch: a loader made before torch.distributed
    is initialized shards once it is), and torch's writable ``generator`` and
    ``in_order``."""

    num_workers: int
    rank: int = 0
    world_size: int = 1
    generator: Any = None
    in_order: bool = True
    prefetch_factor: int = 0  # batches per worker torch's iterator sends ahead (0 without workers)


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
    # torch's RNG: what it drew for this iteration (None under the seed scheme).
    draws: Draws | None = None
    reseed: bool = True  # the workers seed their RNGs at this epoch (see Draws.reseed)
    sample_seed: int = 0  # the epoch's seed for sample_rng (the epoch seed, but see begin_epoch)
    shared_seed: int = 0  # a DataPipe graph's shared seed (the epoch seed, or torch's draw)
    # The seed scheme, the loader's own shuffle: (seed, key) the epoch's order is drawn from
    # (sampling.rng.order_rng); under torch's RNG the order is in ``draws``.
    order_key: tuple[int, int] | None = None


@dataclass
class Cursor:
    """Where a loader is between and within epochs (the loader holds one; only
    :mod:`shmloader.epoch.state` reads or moves it).

    Under torch's RNG (``seeds`` None) each iterator draws what torch's would when it is
    made (:func:`draw_for_iter`) and its epoch is a function of those draws. Under the
    seed scheme every epoch's order and worker seeds are functions of ``seed`` and the
    epoch; with a numpy ``generator=``, ``seed`` is drawn again from it at each epoch, so
    reseeding the generator before an epoch repeats it."""

    seeds: SeedSource | None  # the seed scheme's source; None: torch's RNG decides
    seed: int | None = None  # the seed scheme's seed (None until the first epoch draws it)
    next_epoch: int = 0  # the epoch the next iter() loads (set_epoch, or one more)
    resume: dict[str, Any] | None = None  # a loaded position, for the next iter()
    plan: EpochPlan | None = None  # the running (or last) epoch
    live: weakref.ref | None = None  # its iterator (or a pending one), which state_dict() asks
    pending: Draws | None = None  # torch's RNG: what iter() drew for ``live``, until it begins
    workers_base: int | None = None  # torch's RNG: the base seed the running workers got
    # torch's RNG, persistent workers: workers_base is a loaded run's, whose workers the
    # next ones continue (they take its base seed instead of drawing one).
    loaded_base: bool = False

    @property
    def torch_rng(self) -> bool:
        """Whether torch's RNG decides (see :mod:`shmloader.sampling.draws`)."""
        return self.seeds is None
