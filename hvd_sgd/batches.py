"""The data order and the input pipelines that follow it.

The order is a function of (seed, epoch, global batch) alone: each epoch is one global
permutation cut into global batches, and rank r takes the r-th slice of each. So N ranks with
batch B see, step by step, exactly the examples one rank with batch N*B sees. With gradient
accumulation a rank's slice is cut again into micro-batches, one per backward pass.

An epoch is a number of steps fixed when the run starts (``steps_per_epoch``). In an elastic
job whose size changes, a step still updates the weights once, with the new global batch:
an epoch then covers fewer examples (or, grown, wraps around its permutation).
"""
import numpy as np
import tensorflow as tf

from hvd_sgd import JobError, datasets


def steps_per_epoch(num_examples, per_rank_batch, world_size, micro_batches=1):
    """Full global batches per epoch; every rank runs this many steps. A JobError if none fits."""
    if world_size > num_examples:
        raise JobError(f"{world_size} ranks but only {num_examples} training examples")
    steps = num_examples // (per_rank_batch * micro_batches * world_size)
    if steps == 0:
        batch = f"--batch-size {per_rank_batch}" + (f" x {micro_batches} backward passes" if micro_batches > 1 else "")
        raise JobError(f"{batch} is larger than a rank's shard "
                       f"({num_examples} examples / {world_size} ranks = {num_examples // world_size})")
    return steps


def epoch_order(num_examples, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def rank_batch_indices(num_examples, rank_batch, world_size, rank, seed, first_step, last_step, per_epoch):
    """Example indices of this rank's batches for global steps [first_step, last_step): [steps, rank_batch].
    One epoch's permutation at a time: a run's worth of them at once took a rank seconds and GBs."""
    global_batch = rank_batch * world_size
    indices = np.empty((last_step - first_step, rank_batch), np.int64)
    for epoch in range(first_step // per_epoch, -(-last_step // per_epoch)):
        begin, end = max(first_step, epoch * per_epoch), min(last_step, (epoch + 1) * per_epoch)
        start = epoch * per_epoch
        order = epoch_order(num_examples, seed, epoch)
        if len(order) < per_epoch * global_batch:  # an elastic job grown since the epoch was fixed: wrap around
            order = np.resize(order, per_epoch * global_batch)
        epoch_batches = order[:per_epoch * global_batch].reshape(per_epoch, world_size, rank_batch)
        indices[begin - first_step:end - first_step] = epoch_batches[begin - start:end - start, rank]
    return indices


def step_batches(splits, indices):
    """For a compiled step: a function whose every call (inside the step) takes the next row of
    ``indices`` and gathers its batch, (images float32 [B, h, w, 1] in [0, 1], labels int32 [B]).

    One gather in the step's own graph: a tf.data pipeline's thread costs a rank that has one core
    more than the gather itself (docs/benchmarks.md, "The batch gathered inside the step")."""
    with tf.device("CPU"):  # the training set stays in host memory: only a batch goes to a GPU
        examples = _Examples(splits, indices)
        taken = tf.Variable(0, dtype=tf.int64, trainable=False, name="batches_taken")

    def next_batch():
        with tf.device("CPU"):
            return examples.gather(tf.gather(examples.rows, taken.assign_add(1) - 1))

    return next_batch


def train_batches(splits, indices):
    """The same batches as a tf.data pipeline, for Keras' ``fit`` (the bench's Keras contenders)."""
    examples = _Examples(splits, indices)
    return _without_autotuner(tf.data.Dataset.from_tensor_slices(examples.rows).map(examples.gather).prefetch(2))


class _Examples:
    """The training set and the batches' rows of indices, as tensors."""

    def __init__(self, splits, indices):
        self.images, self.labels, self.rows = as_tensor(splits.x_train), as_tensor(splits.y_train), as_tensor(indices)

    def gather(self, batch):
        return to_model_input(tf.gather(self.images, batch)), tf.cast(tf.gather(self.labels, batch), tf.int32)


def test_batches(splits, batch_size=1000):
    examples = tf.data.Dataset.from_tensor_slices((as_tensor(splits.x_test), as_tensor(splits.y_test)))
    return _without_autotuner(examples.batch(batch_size).map(lambda x, y: (to_model_input(x), tf.cast(y, tf.int32)))
                              .prefetch(2))


def as_tensor(array):
    """``array`` as a CPU tensor that shares its memory (through DLPack), after a copy into aligned
    memory unless it is there already (datasets reads into such): tf.constant would hold two more
    copies at once, which for a large training set decides whether it fits (docs/benchmarks.md,
    "Memory"). Neither may change while the other is in use."""
    if not (array.flags.c_contiguous and array.flags.writeable and array.ctypes.data % datasets.ALIGNMENT == 0):
        aligned = datasets.aligned_empty(array.shape, array.dtype)
        aligned[...] = array
        array = aligned
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def to_model_input(images):
    """A batch of uint8 images, [b, h, w] (grayscale) or [b, h, w, c] -> float32 [b, h, w, c] in
    [0, 1]: what every model takes."""
    images = tf.cast(images, tf.float32) / 255.0
    return images[..., None] if images.shape.rank == 3 else images


def _without_autotuner(pipeline):
    """A batch is one gather (microseconds): the fixed prefetch keeps the model fed, and tf.data's
    autotuner has nothing to tune, while its thread can hold up the iterator's deletion for
    seconds in TensorFlow 2.15 (docs/benchmarks.md)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return pipeline.with_options(options)
