"""Between the consumer and a worker: task and result queues in shared memory, frames on a
socket.
"""
