"""The built-in benchmark: this loader beside torch's DataLoader, in one run.

Every figure is a ratio of two systems measured in the same run: for each workload and
worker count the peers are this loader, ``torch.utils.data.DataLoader`` on the *same*
dataset object with the same settings, this loader with ``num_workers=0``, and the copy
ceiling (as many processes as workers doing nothing but ``np.copyto`` of the same bytes
into as many batch-sized buffers as the ring has slots). Each peer is warmed up first,
then timed ``repeat`` times, the peers alternating inside each repeat; the report gives
the median, the spread ((max - min) / median) and ratios paired within a repeat.

Each timed repeat is bounded twice: ``batches`` batches or ``seconds`` seconds, whichever
comes first, so a fast loader gets many batches and a slow one does not run for minutes.

A fresh (non-persistent) loader's short epoch is measured separately, the peers
alternating: the **cold** figure (constructor to the last batch of a ``cold_batches``-batch
epoch, worker start-up and the first ring included), with time to first batch from the
same runs. Peak consumer memory and the system's shared-memory use in a fresh subprocess per
loader, so one loader's allocations never count against the other.

The modules, one concept each:

- :mod:`~shmloader.bench.datasets`: the synthetic datasets (W1-W5, W7, W8) and W7's padding;
- :mod:`~shmloader.bench.workloads`: workloads, variants, configurations, loader options;
- :mod:`~shmloader.bench.peers`: the one harness (peers warmed up, timed alternating) and
  the DataLoader peer; :mod:`~shmloader.bench.ceiling`: the copy-ceiling peer;
  :mod:`~shmloader.bench.consume`: what every peer's consumer does with a batch (reads
  every page of it); :mod:`~shmloader.bench.decodelimit`: W6's decode limit;
- :mod:`~shmloader.bench.measure`: one configuration of W1-W5, W7 (steady, cold, memory);
  :mod:`~shmloader.bench.jpeg`: W6, the JPEG folder, on the same harness;
  :mod:`~shmloader.bench.metadata`: W8, a million metadata records, workers' memory and
  time to first batch, a fresh process per measurement;
- :mod:`~shmloader.bench.memory`: the memory probe, in a fresh process per loader;
- :mod:`~shmloader.bench.results`, :mod:`~shmloader.bench.report`, :mod:`~shmloader.bench.plot`:
  the figures, their tables (text, markdown, JSON) and the chart;
- :mod:`~shmloader.bench.machine`: what the figures depend on; :mod:`~shmloader.bench.progress`;
- :mod:`~shmloader.bench.cli`: ``shmloader bench``.

The targets the figures are judged by are the project's, not the library's: they live in
``benchmarks/targets.py`` (``python benchmarks/run.py`` prints them).

Run it as ``shmloader bench`` (see ``shmloader bench --help``), ``python -m shmloader.bench``
or :func:`main`.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``shmloader bench``: run the benchmark and print the tables (see :mod:`shmloader.bench.cli`)."""
    from shmloader.bench.cli import main as _main

    return _main(argv)
