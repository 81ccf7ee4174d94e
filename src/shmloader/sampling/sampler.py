"""Samplers: which sample indices make up each batch, in which order.

Same names and meanings as ``torch.utils.data``'s samplers. A :class:`RandomSampler`
draws as torch's does from torch's RNG, or from a numpy ``Generator`` (a loader's
``seed`` then fixes every epoch's order); each ``iter()`` draws a new permutation.

Where torch is imported, a sampler made here is also an instance of its torch counterpart
(``torch.utils.data.RandomSampler`` for :class:`RandomSampler`, and so on; see
:mod:`shmloader.interop.torchcompat`), so frameworks that look for torch's classes recognise it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, Generic, TypeVar

import numpy as np

from shmloader.interop import torchcompat

T_co = TypeVar("T_co", covariant=True)


class Sampler(Generic[T_co]):
    """Base class of samplers: an iterable of sample indices (optionally sized)."""

    _torch_name = "Sampler"  # the torch.utils.data class an instance also is, with torch

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(torchcompat.flavoured(cls, cls._torch_name))

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError


class SequentialSampler(Sampler):
    """Indices ``0 .. len(data_source) - 1`` in order."""

    _torch_name = "SequentialSampler"

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(Sampler):
    """Indices in random order: a new permutation on every ``iter()``.

    ``replacement=True`` draws ``num_samples`` indices with replacement. ``generator``: a
    ``torch.Generator`` or None with torch imported draws as torch's ``RandomSampler``
    does, bit for bit (from the generator, or from a generator seeded with one int64 of
    torch's global RNG, when the iterator is first advanced); a numpy ``Generator``
    draws from it; None without torch draws from fresh entropy.
    """

    _torch_name = "RandomSampler"

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: Any = None,
    ) -> None:
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got replacement={replacement!r}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples <= 0):
            raise ValueError(
                f"num_samples should be a positive integer value, but got num_samples={num_samples!r}"
            )
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator

    @property
    def num_samples(self) -> int:
        """How many indices one pass yields."""
        return len(self.data_source) if self._num_samples is None else self._num_samples

    # Set by the loader that made this sampler (set_next_order), for its next iter() only:
    # the order of the epoch it is beginning (the indices torch's RNG drew, or the seed
    # scheme's generator). ``generator`` stays what torch's would be (the loader's
    # generator=, or None), so a framework may set a torch Generator and synchronize it
    # (Accelerate does).
    _epoch_order: list[int] | None = None
    _epoch_rng: np.random.Generator | None = None

    def set_next_order(
        self, *, indices: list[int] | None = None, rng: np.random.Generator | None = None
    ) -> None:
        """Make the next ``iter()``, and only it, yield ``indices``, or else draw its
        permutation from ``rng``; with neither, it draws as ever (from ``generator``).
        The loader that made this sampler calls it as an epoch begins."""
        self._epoch_order = indices
        self._epoch_rng = rng

    def __iter__(self) -> Iterator[int]:
        order, self._epoch_order = self._epoch_order, None
        if order is not None:
            return iter(order)
        rng, self._epoch_rng = self._epoch_rng, None
        if rng is None:
            torch = sys.modules.get("torch")
            if torch is not None and (self.generator is None or isinstance(self.generator, torch.Generator)):
                return self._torch_order(torch)
            rng = self.generator if self.generator is not None else np.random.default_rng()
        n = len(self.data_source)
        if self.replacement:
            return iter(rng.integers(0, n, self.num_samples).tolist())
        full, rest = divmod(self.num_samples, n) if n else (0, 0)
        order = [rng.permutation(n) for _ in range(full)] + [rng.permutation(n)[:rest]]
        return iter(np.concatenate(order).tolist())

    def __len__(self) -> int:
        return self.num_samples

    def _torch_order(self, torch: Any) -> Iterator[int]:
        """torch's ``RandomSampler.__iter__``, draw for draw and when it draws (at the
        first ``next()``, and each chunk as it is reached)."""
        n = len(self.data_source)
        if self.generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        else:
            generator = self.generator
        if self.replacement:
            for _ in range(self.num_samples // 32):
                yield from torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator).tolist()
            yield from torch.randint(
                high=n, size=(self.num_samples % 32,), dtype=torch.int64, generator=generator
            ).tolist()
        elif n:
            for _ in range(self.num_samples // n):
                yield from torch.randperm(n, generator=generator).tolist()
            yield from torch.randperm(n, generator=generator).tolist()[: self.num_samples % n]


class BatchSampler(Sampler):
    """Groups the indices of ``sampler`` into lists of ``batch_size``; ``drop_last``
    drops a final shorter list."""

    _torch_name = "BatchSampler"

    def __init__(self, sampler: Iterable[Any], batch_size: int, drop_last: bool) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(
                f"batch_size should be a positive integer value, but got batch_size={batch_size!r}"
            )
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last!r}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[Any]]:
        batch: list[Any] = []
        size = self.batch_size
        for idx in self.sampler:
            batch.append(idx)
            if len(batch) == size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


class LoaderBatchSampler(BatchSampler):
    """The batch sampler a loader makes for itself (``loader.batch_sampler``). Once the
    loader bound it (:meth:`follow`), iterating it yields what the loader's next epoch
    loads (:func:`shmloader.epoch.state.upcoming_batches`: the global index lists, not a
    draw of its own), so code that rebuilds a loader over it
    (``accelerate.skip_first_batches``, ``accelerator.prepare``) gets this loader's
    batches, and shards them itself. The loader itself reads its sampler directly. Made
    anew by a framework (Lightning's sampler injection), it is a plain
    :class:`BatchSampler`."""

    # The loader's next epoch's batches, worked out when asked (follow()); None: unbound.
    _upcoming: Callable[[], Iterator[list[Any]]] | None = None

    def follow(self, upcoming: Callable[[], Iterator[list[Any]]]) -> None:
        """Yield what ``upcoming()`` (a generator) yields on each ``iter()`` from now on.
        ``upcoming`` holds no reference to the loader (whose ring and workers go when it
        is dropped)."""
        self._upcoming = upcoming

    def __iter__(self) -> Iterator[list[Any]]:
        # Both are generators: nothing is drawn before the first next(), as torch's
        # BatchSampler (torch's DataLoader makes two iterators of it per epoch).
        if self._upcoming is None:
            return super().__iter__()
        return self._upcoming()


class BucketBatchSampler(Sampler):
    """Batches of samples of similar length, so padded batches waste little.

    ``lengths[i]`` is sample ``i``'s length. Samples fall into buckets of ``bucket_width``
    lengths each, or into ``num_buckets`` buckets of equal counts (by length order); each
    batch is drawn from one bucket. With ``shuffle`` the samples within a bucket and the
    order of the batches change every epoch; the order is a function of ``seed`` and the
    epoch only (``set_epoch``, or one more on every ``iter()``). ``drop_last`` drops each
    bucket's final short batch.
    """

    def __init__(
        self,
        lengths: Iterable[int],
        batch_size: int,
        bucket_width: int | None = None,
        num_buckets: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.lengths = np.asarray(list(lengths), dtype=np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise ValueError("lengths should be a non-empty sequence of one length per sample")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(
                f"batch_size should be a positive integer value, but got batch_size={batch_size!r}"
            )
        if bucket_width is not None and num_buckets is not None:
            raise ValueError("pass bucket_width or num_buckets, not both")
        if bucket_width is not None and bucket_width <= 0:
            raise ValueError(f"bucket_width should be a positive integer, got {bucket_width!r}")
        if num_buckets is not None and num_buckets <= 0:
            raise ValueError(f"num_buckets should be a positive integer, got {num_buckets!r}")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        order = np.argsort(self.lengths, kind="stable")
        if bucket_width is not None:
            keys = self.lengths[order] // bucket_width
            cuts = np.flatnonzero(np.diff(keys)) + 1
        else:
            n = num_buckets if num_buckets is not None else 8
            cuts = np.linspace(0, len(order), min(n, len(order)) + 1).astype(int)[1:-1]
        self.buckets = [b for b in np.split(order, cuts) if len(b)]
        self.epoch = 0  # the epoch the next iter() yields

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order on the next ``iter()`` (as DistributedSampler does)."""
        self.epoch = epoch

    def _batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        batches = []
        for bucket in self.buckets:
            members = rng.permutation(bucket) if self.shuffle else bucket
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                if len(chunk) == self.batch_size or not self.drop_last:
                    batches.append(chunk.tolist())
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        return iter(self._batches(epoch))

    def __len__(self) -> int:
        size = self.batch_size
        if self.drop_last:
            return sum(len(b) // size for b in self.buckets)
        return sum(-(-len(b) // size) for b in self.buckets)
