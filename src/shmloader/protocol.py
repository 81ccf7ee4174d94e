"""The messages between the consumer and a worker: a fixed header and a small payload.

Each worker has one socket pair with the consumer. Tasks go one way, results the other;
both are ``Connection.send_bytes`` frames, never pickles in the common case: a task is
the slot number, the batch's sequence number and its sample indices as int64 bytes; a
result is the slot number. The same socket is the worker's lifeline: when the consumer
dies the kernel closes its end, and the worker's blocking read returns EOF.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("<Bxxxiq")  # kind, slot (-1: none), batch sequence number
HEADER_BYTES = HEADER.size

# consumer -> worker
TASK_INDICES = 1  # payload: int64 sample indices
TASK_KEYS = 2  # payload: pickled list of sample keys (a sampler yielding non-int keys)
TASK_ITER = 3  # iterable dataset: produce the next batch; no payload
TASK_EPOCH = 4  # persistent workers, new epoch: payload int64 [base_seed]
TASK_STOP = 5
TASK_RING = 6  # payload: int64 [num_slots, slot_bytes]; the descriptor follows (SCM_RIGHTS)

# worker -> consumer
RES_READY = 11  # the batch is in the slot
RES_PICKLED = 12  # payload: int64 bytes the batch needs in a slot, then the pickled batch
RES_ERROR = 13  # payload: pickled WorkerFailure
RES_ITER_END = 14  # iterable dataset exhausted in this worker
RES_INIT_ERROR = 15  # payload: pickled WorkerFailure; the worker exits after sending it
RES_SHARD_STATE = 16  # payload: pickled dataset.state_dict() after batch `seq` (before its result)
RES_STATS = 17  # payload: pickled {name: increase} of the dataset's stats() counters
# The consumer checks kinds >= RES_INIT_ERROR with one comparison, off the per-batch path:
# give a new rare kind a number above these and handle it in that branch.

NO_SLOT = -1


def pack(kind: int, slot: int = NO_SLOT, seq: int = 0, payload: bytes = b"") -> bytes:
    """One frame: header then payload."""
    return HEADER.pack(kind, slot, seq) + payload
