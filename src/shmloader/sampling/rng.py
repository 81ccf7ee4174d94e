"""Reproducible randomness: epoch seeds and the per-sample generator.

A seeded :class:`~shmloader.DataLoader` (``seed=``) gives every epoch a seed that is a
function of the loader's seed and the epoch number only (:func:`derive_epoch_seed`); a
loader under torch's RNG (no ``seed=``) uses the base seed torch's loader draws at
``iter()`` (see :mod:`shmloader.sampling.draws`). Worker ``k`` is seeded with ``epoch_seed + k``
(as torch's loader does with its base seed), and
:func:`sample_rng` gives each sample a generator seeded from ``(epoch_seed, index)``: a
sample's random augmentation is then the same whichever worker loads it, however many
workers or ranks there are, and after a resume from a checkpoint.

Use it inside ``__getitem__`` (or a transform)::

    def __getitem__(self, i):
        rng = shmloader.sample_rng(i)
        flip = rng.random() < 0.5
        ...

``shmloader.vision``'s random transforms draw from the same generator.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from shmloader.context import get_worker_info, main_epoch, worker_epoch_seed

_MASK64 = 2**64 - 1
_EPOCH_SEED_BOUND = 2**62  # epoch seeds are drawn below this, as the loader always did


def derive_epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch`` of a loader seeded with ``seed``."""
    return int(np.random.default_rng([seed & _MASK64, epoch & _MASK64]).integers(0, _EPOCH_SEED_BOUND))


def order_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator of epoch ``epoch``'s global sample order (a stream separate from the
    epoch seed's, so workers' draws and the shuffle never share numbers)."""
    return np.random.default_rng([seed & _MASK64, epoch & _MASK64, 1])


def epoch_seed() -> int | None:
    """The seed of the epoch being loaded, the same in every worker and rank; None
    outside a loader's epoch.

    In a worker it is the worker's seed minus its id (with persistent workers under
    torch's RNG, which keep their seed, one derived from it and the epoch); in the main
    process, the seed of the epoch a ``num_workers=0`` loader is producing; in a torch
    DataLoader worker, torch's base seed (so a dataset written for shmloader also works
    under torch's loader)."""
    info = get_worker_info()
    if info is not None:
        own = worker_epoch_seed()
        return own if own is not None else int(info.seed) - int(info.id)
    main = main_epoch()
    if main is not None:
        return main[0]
    torch = sys.modules.get("torch")
    if torch is not None:
        tinfo = torch.utils.data.get_worker_info()
        if tinfo is not None:
            return int(tinfo.seed) - int(tinfo.id)
    return None


def sample_rng(index: Any) -> np.random.Generator:
    """A numpy ``Generator`` for sample ``index`` of the current epoch.

    Seeded from ``(epoch seed, index)``, i.e. from the loader's seed, the epoch and the
    index: the same draws in whichever worker, rank or run loads the sample, and new
    draws every epoch. ``index`` is an int (or anything ``int()`` accepts). Outside a
    loader's epoch (no epoch seed known) the generator is seeded from numpy's global
    RNG, so ``np.random.seed`` still makes a script reproducible."""
    base = epoch_seed()
    if base is None:
        return np.random.default_rng(int(np.random.randint(0, 2**63 - 1, dtype=np.int64)))
    return np.random.default_rng([base & _MASK64, int(index) & _MASK64])
