"""Adapters for training frameworks that replace a torch DataLoader with their own.

Lightning and Fabric need none: where torch is imported a ``shmloader.DataLoader`` is a
``torch.utils.data.DataLoader``, so they use it (and rebuild it with their
``DistributedSampler``) as they would torch's. Hugging Face Accelerate's
``accelerator.prepare`` instead rebuilds the loader as its own ``DataLoaderShard``
driving torch's workers, so :mod:`shmloader.integrations.accelerate` offers the way that
keeps shmloader's.

Each submodule imports its framework only when used; ``import shmloader`` never does.
"""
