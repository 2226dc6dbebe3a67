"""The rank roles: who this rank is, and what every rank does together.

Rank 0 is the chief. What only it does (evaluate, log, write files) is written where it happens,
as ``if world.is_chief:``; this module holds the collectives that keep the ranks in step.
"""
import contextlib
import dataclasses
import os
import socket
import sys
import zlib

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_sgd import JobError


@dataclasses.dataclass(frozen=True)
class World:
    """This rank's place in the job. Rank and size are read from Horovod each time: in elastic
    mode they change when workers leave or join."""
    device: str
    threads: int
    started: dict = dataclasses.field(default_factory=dict)  # when start-up's phases ended (time.time())

    @property
    def rank(self):
        return hvd.rank()

    @property
    def size(self):
        return hvd.size()

    @property
    def is_chief(self):
        return self.rank == 0

    def placement(self):
        """Where this rank runs: its host, its place among the node's ranks and across nodes, its CPUs."""
        return dict(rank=hvd.rank(), host=socket.gethostname(), local_rank=hvd.local_rank(),
                    local_size=hvd.local_size(), cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(),
                    cpus=sorted(os.sched_getaffinity(0)), device=self.device)

    def log(self, message):
        """Progress lines come from the chief alone (one write per line: launchers tag each write)."""
        if self.is_chief:
            sys.stdout.write(f"{message}\n")
            sys.stdout.flush()

    @contextlib.contextmanager
    def agreement(self):
        """Run a block on every rank; if it raises JobError on any rank, it raises on all of them.

        Without this, a check that fails on one rank only (rank 0 cannot write the checkpoint
        directory, say) leaves the other ranks waiting in the next collective for ever.
        """
        error = None
        try:
            yield
        except JobError as e:
            error = str(e)
        failures = [(rank, e) for rank, e in enumerate(hvd.allgather_object(error)) if e is not None]
        if failures:
            rank, message = failures[0]
            raise JobError(message if len(failures) == self.size else f"rank {rank}: {message}")

    def average_statistics(self, model):
        """Each rank updates the float non-trainable variables (BatchNormalization's moving mean and
        variance) from its own batches, so they drift apart: make every rank hold their mean over
        the ranks. For a moving mean that is the moving average of the global batch's means."""
        statistics = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        if statistics and self.size > 1:
            averaged = hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in statistics], op=hvd.Average)
            for variable, value in zip(statistics, averaged):
                variable.assign(value)

    def evaluate(self, model, test_batches, after_batch):
        """Rank 0 evaluates the (compiled) model, calling ``after_batch()`` after each batch (the
        watchdog's progress: the other ranks wait meanwhile); every rank receives the result."""
        if self.is_chief:
            each_batch = tf.keras.callbacks.LambdaCallback(on_test_batch_end=lambda batch, logs: after_batch())
            result = model.evaluate(test_batches, verbose=0, return_dict=True, callbacks=[each_batch])
        else:
            result = None
        return hvd.broadcast_object(result, root_rank=0)

    def check_identical(self, variables, when):
        """All ranks must hold bit-identical weights; anything else means training has forked."""
        digest = 0
        for v in variables:
            digest = zlib.crc32(v.numpy().tobytes(), digest)
        digests = hvd.allgather_object(digest)
        if len(set(digests)) != 1:
            raise JobError(f"ranks hold different weights {when} (checksums {digests})")
        return digests
