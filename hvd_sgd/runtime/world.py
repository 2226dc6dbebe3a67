"""The rank roles: who this rank is, and what every rank does together.

Rank 0 is the chief, and ``world.is_chief`` is the one way to ask: what only it does is its
progress lines (``log``) and its files (hvd_sgd.training.outputs). This module holds the
collectives that keep the ranks in step.
"""
import contextlib
import dataclasses
import os
import socket
import sys
import zlib

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvd_sgd import JobError
from hvd_sgd.runtime import announced


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
        return announced.is_chief()

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

    def evaluate(self, model, test_batches, watchdog):
        """Test accuracy and loss (mean cross-entropy) of ``model``, the same on every rank, telling
        ``watchdog`` of each batch's progress and of each batch shape's first call (it traces the
        evaluation's graph). Every rank evaluates its own share of the test set (``test_batches``)
        and the sums are all-reduced: the same correct count as one process evaluating the whole
        set, in about 1/size of the time."""
        sums, shapes = np.zeros(3), set()  # correct, summed loss, examples; the shapes called with
        for images, labels in test_batches:
            with watchdog.tracing(first_call=images.shape not in shapes):
                sums += [float(s) for s in _evaluation_sums(model, images, labels)]
            shapes.add(images.shape)
            watchdog.progress()
        correct, loss, examples = hvd.allreduce(tf.constant(sums), op=hvd.Sum, name="evaluation").numpy()
        return dict(accuracy=correct / examples, loss=loss / examples, correct=int(correct), examples=int(examples))

    def check_identical(self, variables, when):
        """All ranks must hold bit-identical weights; anything else means training has forked. Every
        rank's checksum."""
        return require_identical(hvd.allgather_object(checksum(variables)), when)


def checksum(variables):
    """A CRC-32 of the variables' values, bit for bit."""
    digest = 0
    for v in variables:
        digest = zlib.crc32(v.numpy().tobytes(), digest)
    return digest


def require_identical(checksums, when):
    """``checksums``, every rank's, as they are; JobError naming them when any two differ."""
    if len(set(checksums)) != 1:
        raise JobError(f"ranks hold different weights {when} (checksums {checksums})")
    return checksums


@tf.function(reduce_retracing=True)
def _evaluation_sums(model, images, labels):
    """A test batch's correct answers, summed cross-entropy and examples."""
    logits = tf.cast(model(images, training=False), tf.float32)
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float64))
    loss = tf.reduce_sum(tf.cast(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits), tf.float64))
    return correct, loss, tf.cast(tf.size(labels), tf.float64)
