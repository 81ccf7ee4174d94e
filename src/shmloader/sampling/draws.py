"""Where a loader's randomness comes from, and when it is drawn.

Two schemes, chosen when the loader is made (:func:`uses_torch_rng`).

**torch's RNG** (no ``seed=``; ``generator=`` a ``torch.Generator``, or none with torch
imported): every draw is the one torch's DataLoader makes, when torch makes it, so the
order, the workers' seeds and whatever the program draws from torch's RNG afterwards
(a model's weights, dropout) are bit-identical to torch's loader:

- nothing when the loader is made;
- when an iterator is made (``iter()``): for a DataPipe, the graph's shared seed; then
  the workers' base seed, one int64 each from ``loader.generator`` (torch's global RNG
  when None), also with ``num_workers=0``. A persistent iterator that is reused draws
  no base seed: its workers keep theirs, and their RNGs go on from where they were;
- the loader's own ``RandomSampler`` draws its order when it is first advanced: with
  workers at ``iter()`` (torch primes its prefetch there), with ``num_workers=0`` at the
  first ``next()``; from ``sampler.generator``, or (None) from a new generator seeded
  with an int64 from the global RNG (:func:`sampler_order`). The sampler's last draw,
  a ``randperm`` of which it yields nothing (:class:`Tail`), is made when torch's
  sampler runs out: where torch's iterator asks it for the index list after the last,
  ``prefetch_factor * num_workers`` lists ahead of the batches handed out;
- worker ``k`` seeds ``random`` and torch with ``base_seed + k`` and numpy's global RNG
  with torch's ``_generate_state(base_seed, k)`` (:mod:`shmloader.workers.seeding`); the main
  process seeds nothing.

What was drawn is kept (:class:`Draws`) so ``state_dict()`` resumes an epoch exactly: the
base seed, and the order's seed (or the generator's state before the order was drawn).

**shmloader's seed** (``seed=`` an int, ``generator=`` a numpy ``Generator``, or neither
without torch): every epoch's order and worker seeds are functions of one seed and the
epoch number (:class:`SeedSource`, :mod:`shmloader.sampling.rng`).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_SEED_BOUND = 2**62  # the seed scheme's seeds are below this, as the loader's always were


def uses_torch_rng(seed: int | None, generator: Any) -> bool:
    """Whether a loader made with these arguments draws from torch's RNG (see the module's
    docstring). A ``generator`` that is neither a numpy nor a torch Generator is a TypeError."""
    if seed is not None or isinstance(generator, np.random.Generator):
        return False
    torch = sys.modules.get("torch")
    if generator is not None:
        if torch is None or not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a numpy.random.Generator or a torch.Generator, got "
                f"{type(generator).__name__}; or pass seed=<int>."
            )
        return True
    return torch is not None


def fold(seed: int) -> int:
    """A seed below 2**62 (the seed scheme's seeds always were), drawn from ``seed``."""
    return int(np.random.default_rng(seed & (2**64 - 1)).integers(0, _SEED_BOUND))


class SeedSource:
    """Where a loader using shmloader's seed scheme gets its seed: ``seed`` (one seed for
    the loader's life), a numpy ``generator`` (a new seed from it for each epoch), or
    neither (one draw from numpy's global RNG, when the first epoch begins). Nothing is
    drawn when the loader is made."""

    def __init__(self, seed: int | None = None, generator: np.random.Generator | None = None) -> None:
        self.generator = generator
        self.fixed = fold(seed) if seed is not None else None

    @classmethod
    def of_seed(cls, seed: int) -> SeedSource:
        """A source whose seed is ``seed`` as it stands (a seed a state saved)."""
        source = cls()
        source.fixed = int(seed)
        return source

    @property
    def each_epoch(self) -> bool:
        """Whether every epoch draws a new seed (a numpy generator)."""
        return self.generator is not None

    def draw(self) -> int:
        """The next seed (moves the generator, or numpy's global RNG, where it draws)."""
        if self.fixed is not None:
            return self.fixed
        if self.generator is not None:
            return int(self.generator.integers(0, _SEED_BOUND))
        return int(np.random.randint(0, _SEED_BOUND, dtype=np.int64))

    def peek(self) -> int:
        """What :meth:`draw` would return now, moving nothing."""
        if self.fixed is not None:
            return self.fixed
        if self.generator is not None:
            return int(copy.deepcopy(self.generator).integers(0, _SEED_BOUND))
        rs = np.random.RandomState()
        rs.set_state(np.random.get_state())
        return int(rs.randint(0, _SEED_BOUND, dtype=np.int64))

    def detached(self) -> SeedSource:
        """A copy whose draws move nothing of the user's: its generator is a copy of this
        one's; numpy's global RNG is read (:meth:`peek`), not drawn from."""
        other = SeedSource()
        other.fixed = self.fixed
        if self.generator is not None:
            other.generator = copy.deepcopy(self.generator)
        elif self.fixed is None:
            other.fixed = self.peek()
        return other

    def generator_state(self) -> dict[str, Any] | None:
        """The numpy generator's state as plain data (None without one)."""
        if self.generator is None:
            return None
        return _plain(self.generator.bit_generator.state)

    def set_generator_state(self, state: dict[str, Any]) -> None:
        """Put the numpy generator where ``state`` (from :meth:`generator_state`) says."""
        if self.generator is not None:
            self.generator.bit_generator.state = state


def _plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars made lists and Python numbers."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


# --- torch's draws -----------------------------------------------------------------------


@dataclass
class Draws:
    """What torch's RNG decided for one iteration (torch's scheme)."""

    base_seed: int  # the workers' base seed: worker k's seed is base_seed + k
    # Whether the workers seed their RNGs with it at this epoch (False: a reused persistent
    # iterator, whose workers keep their RNGs' state, as torch's do).
    reseed: bool = True
    shared_seed: int | None = None  # a DataPipe graph's shared seed, drawn first
    # The loader's RandomSampler's draw: {"seed": s} (a generator seeded with s) or
    # {"state": [...]} (its generator's state before it drew); None: not drawn yet.
    order: dict[str, Any] | None = None
    indices: list[int] | None = field(default=None, repr=False, compare=False)  # that order
    # The order's last draw, owed until the iterator hands out its ``tail_due``-th batch
    # (torch's sampler runs out then; see Tail). None: nothing owed.
    tail: Tail | None = field(default=None, repr=False, compare=False)
    tail_due: int = field(default=sys.maxsize, compare=False)
    # A resumed epoch whose saved run still owed its order's last draw: owed again.
    tail_resumed: bool = field(default=False, compare=False)

    def to_state(self) -> dict[str, Any]:
        """As plain data, for ``state_dict()``."""
        state = {"base_seed": self.base_seed, "shared_seed": self.shared_seed, "order": self.order}
        if self.tail is not None or self.tail_resumed:
            state["tail_owed"] = True
        return state

    def owe(self, tail: Tail | None, due: int) -> None:
        """The order's last draw is owed until ``due`` batches were handed out (at
        ``due <= 0``: when the iterator is made; :meth:`pay_due` then pays it)."""
        self.tail = tail
        self.tail_due = due if tail is not None else sys.maxsize

    def pay_due(self, handed_out: int) -> None:
        """Make the owed last draw if ``handed_out`` batches reach its due point."""
        if self.tail is not None and handed_out >= self.tail_due:
            self.pay()

    def pay(self) -> None:
        """Make the owed last draw now (the epoch ended, or its point was reached)."""
        tail, self.tail = self.tail, None
        self.tail_due = sys.maxsize
        self.tail_resumed = False
        if tail is not None:
            tail.pay()

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Draws:
        """From :meth:`to_state`'s data: the draws of a resumed epoch (its workers are new:
        they seed their RNGs)."""
        order = state.get("order")
        return cls(
            base_seed=int(state["base_seed"]),
            shared_seed=None if state.get("shared_seed") is None else int(state["shared_seed"]),
            order=dict(order) if order is not None else None,
            tail_resumed=bool(state.get("tail_owed")),
        )


def int64(generator: Any) -> int:
    """One int64 drawn as torch's DataLoader draws its seeds, from ``generator`` (torch's
    global RNG when None)."""
    torch = sys.modules["torch"]
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class Tail:
    """The last draw of torch's ``RandomSampler`` without replacement when its
    ``num_samples`` is a multiple of the dataset's length: a ``randperm`` of which it
    yields nothing. torch makes it when the sampler runs out, which is when the
    generator shared with the loader's seeds moves for it; until then it is owed."""

    def __init__(self, generator: Any, n: int) -> None:
        self.generator = generator
        self.n = n
        self.owed = True

    def pay(self) -> None:
        """Draw it now, once."""
        if self.owed:
            self.owed = False
            sys.modules["torch"].randperm(self.n, generator=self.generator)


def sampler_order(sampler: Any, generator: Any, trailing: bool = True) -> list[int]:
    """The indices torch's ``RandomSampler.__iter__`` yields for ``sampler`` (its
    ``data_source``, ``replacement`` and ``num_samples``) when it draws from
    ``generator``, drawn all at once, in torch's calls (randint in chunks of 32, one
    randperm per pass). ``trailing=False`` leaves out a last randperm that yields
    nothing (see :class:`Tail`)."""
    torch = sys.modules["torch"]
    n = len(sampler.data_source)
    count = sampler.num_samples
    out: list[int] = []
    if n == 0:
        return out
    if sampler.replacement:
        for _ in range(count // 32):
            out += torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator).tolist()
        out += torch.randint(high=n, size=(count % 32,), dtype=torch.int64, generator=generator).tolist()
    else:
        for _ in range(count // n):
            out += torch.randperm(n, generator=generator).tolist()
        if trailing or count % n:
            out += torch.randperm(n, generator=generator).tolist()[: count % n]
    return out


def draw_order(sampler: Any) -> tuple[dict[str, Any], list[int], Tail | None]:
    """Draw ``sampler``'s order now as torch's RandomSampler does (from
    ``sampler.generator``, or from a generator seeded by one int64 of the global RNG):
    the record that replays it (:func:`replay_order`), the indices, and the last draw,
    still to make (:class:`Tail`; None where there is none, or where it moves only the
    sampler's own generator, which nothing else reads)."""
    torch = sys.modules["torch"]
    gen = sampler.generator
    if gen is None:
        seed = int64(None)
        own = torch.Generator()
        own.manual_seed(seed)
        return {"seed": seed}, sampler_order(sampler, own, trailing=False), None
    record = {"state": generator_state(gen)}
    return record, sampler_order(sampler, gen, trailing=False), order_tail(sampler, gen)


def order_tail(sampler: Any, generator: Any) -> Tail | None:
    """The last draw torch's RandomSampler makes for ``sampler`` from ``generator`` when
    it runs out, where it yields nothing (see :class:`Tail`); None where there is none."""
    n = len(sampler.data_source)
    if sampler.replacement or n == 0 or sampler.num_samples % n:
        return None
    return Tail(generator, n)


def replay_order(sampler: Any, record: dict[str, Any]) -> list[int]:
    """The indices :func:`draw_order` drew with ``record``, drawn again without moving
    any generator of the user's or torch's global RNG."""
    torch = sys.modules["torch"]
    gen = getattr(sampler, "generator", None)
    device = gen.device if isinstance(gen, torch.Generator) else "cpu"
    own = torch.Generator(device=device)
    if "seed" in record:
        own.manual_seed(int(record["seed"]))
    else:
        set_generator_state(own, record["state"])
    return sampler_order(sampler, own)


_last_state: list[Any] = [None, None]  # (raw bytes, list of ints): generator_state's last answer


def generator_state(generator: Any) -> list[int]:
    """A torch Generator's state as a list of ints (plain data, for a checkpoint). The
    list is shared with later calls that find the same state: do not change it."""
    raw = bytes(generator.get_state().numpy())
    if _last_state[0] != raw:
        _last_state[:] = [raw, list(raw)]
    return _last_state[1]


def set_generator_state(generator: Any, state: list[int]) -> None:
    """Put a torch Generator where ``state`` (from :func:`generator_state`) says; a
    ValueError naming the generator when the state is not one of its kind."""
    torch = sys.modules["torch"]
    try:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(
            f"the saved generator state ({len(state)} bytes) does not fit {generator!r}: "
            "load the state into a loader whose generator= is of the kind it was saved with "
            f"({exc})."
        ) from exc
