"""shmloader: a drop-in DataLoader whose workers write batches straight into one
shared-memory ring, so the consumer gets zero-copy numpy views."""

from shmloader.batch.collate import Padded, collate, default_collate_fn_map
from shmloader.batch.writeinto import ArraySpec
from shmloader.context import ShardInfo, WorkerInfo, get_worker_info
from shmloader.dataset import Dataset, IterableDataset
from shmloader.errors import (
    BatchKeyError,
    BatchLayoutError,
    BatchTypeError,
    CopyOnReadWarning,
    CorruptDataError,
    LoaderTimeoutError,
    RingLimitError,
    RingSizeWarning,
    ShmBackendError,
    ShmLoaderError,
    ShmSpaceError,
    StrayStopIteration,
    WorkerDiedError,
    WorkerError,
    WorkerRestartWarning,
    WorkerStartError,
)
from shmloader.interop.patch import patch_torch
from shmloader.loader import DataLoader
from shmloader.memory.shared import share
from shmloader.sampling.distributed import get_shard_info
from shmloader.sampling.rng import sample_rng
from shmloader.sampling.sampler import (
    BatchSampler,
    BucketBatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

__all__ = [
    "ArraySpec",
    "BatchKeyError",
    "BatchLayoutError",
    "BatchSampler",
    "BatchTypeError",
    "BucketBatchSampler",
    "CopyOnReadWarning",
    "CorruptDataError",
    "DataLoader",
    "Dataset",
    "IterableDataset",
    "LoaderTimeoutError",
    "Padded",
    "RandomSampler",
    "RingLimitError",
    "RingSizeWarning",
    "Sampler",
    "SequentialSampler",
    "ShardInfo",
    "ShmBackendError",
    "ShmLoaderError",
    "ShmSpaceError",
    "StrayStopIteration",
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "WorkerRestartWarning",
    "WorkerStartError",
    "collate",
    "default_collate_fn_map",
    "get_shard_info",
    "get_worker_info",
    "patch_torch",
    "sample_rng",
    "share",
]
__version__ = "0.1.0"
