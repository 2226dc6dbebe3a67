"""The data order and the input pipelines that follow it.

The order is a function of (seed, epoch, global batch) alone: each epoch is one global
permutation cut into global batches, and rank r takes the r-th slice of each. So N ranks with
batch B see, step by step, exactly the examples one rank with batch N*B sees. With gradient
accumulation a rank's slice is cut again into micro-batches, one per backward pass.

An epoch is a number of steps fixed when the run starts (the run plan's). In an elastic
job whose size changes, a step still updates the weights once, with the new global batch:
an epoch then covers fewer examples (or, grown, wraps around its permutation).
"""
import numpy as np
import tensorflow as tf

from hvd_sgd.data import aligned, augment, streams


def epoch_order(num_examples, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def rank_batch_indices(plan, rank, seed, first_step, last_step=None):
    """Example indices of this rank's batches for global steps [first_step, last_step) (to the plan's
    last step by default): [steps, plan.rank_batch]. One epoch's permutation at a time: a run's worth
    of them at once took a rank seconds and GBs."""
    last_step = plan.total_steps if last_step is None else last_step
    per_epoch, global_batch = plan.steps_per_epoch, plan.global_batch
    indices = np.empty((last_step - first_step, plan.rank_batch), np.int64)
    for epoch in range(first_step // per_epoch, -(-last_step // per_epoch)):
        begin, end = max(first_step, epoch * per_epoch), min(last_step, (epoch + 1) * per_epoch)
        start = epoch * per_epoch
        order = epoch_order(plan.num_examples, seed, epoch)
        if len(order) < per_epoch * global_batch:  # an elastic job grown since the epoch was fixed: wrap around
            order = np.resize(order, per_epoch * global_batch)
        epoch_batches = order[:per_epoch * global_batch].reshape(per_epoch, plan.world_size, plan.rank_batch)
        indices[begin - first_step:end - first_step] = epoch_batches[begin - start:end - start, rank]
    return indices


def rank_batches(plan, rank, seed, first_step, augment_image_size=None):
    """This rank's example indices for the plan's steps from ``first_step`` on (rank_batch_indices)
    and, to augment images of ``augment_image_size`` (height, width), each example's crop and flip
    (augment.draws); None without."""
    indices = rank_batch_indices(plan, rank, seed, first_step)
    drawn = augment.draws(plan, augment_image_size, seed, first_step, indices) if augment_image_size else None
    return indices, drawn


def step_batches(splits, indices, augmentation=None):
    """For a compiled step: a function whose every call (inside the step) gives the batch of the next
    row of ``indices``: (images float32 [B, h, w, c] in [0, 1], labels int32 [B]). ``augmentation``:
    (flip, dy, dx) of each example (hvd_sgd.data.augment), or None.

    One gather in the step's own graph (a tf.data pipeline's thread costs a rank that has one core
    more than the gather itself: docs/design.md, "The step"); image files are streamed instead
    (hvd_sgd.data.streams)."""
    with tf.device("CPU"):  # the training set stays in host memory: only a batch goes to a GPU
        examples = _Examples(splits, indices, augmentation)
        taken = tf.Variable(0, dtype=tf.int64, trainable=False, name="batches_taken")

    def next_batch():
        with tf.device("CPU"):
            return examples.gather(taken.assign_add(1) - 1)

    return next_batch


def train_batches(splits, indices):
    """The same batches as a tf.data pipeline, for Keras' ``fit`` (the bench's Keras contenders)."""
    examples = _Examples(splits, indices)
    rows = tf.data.Dataset.range(len(indices))
    return streams.fixed_pipeline(rows.map(examples.gather).prefetch(2))


class _Examples:
    """The training set, the batches' rows of indices, and their augmentation, as tensors."""

    def __init__(self, splits, indices, augmentation=None):
        self.images, self.labels, self.rows = as_tensor(splits.x_train), as_tensor(splits.y_train), as_tensor(indices)
        self.augmentation = None if augmentation is None else [tf.constant(a) for a in augmentation]

    def gather(self, row):
        batch = tf.gather(self.rows, row)
        images = to_model_input(tf.gather(self.images, batch))
        if self.augmentation is not None:
            draws = [tf.gather(a, row) for a in self.augmentation]
            images = tf.map_fn(lambda e: augment.padded_crop_and_flip(*e), (images, *draws),
                               fn_output_signature=tf.float32)
        return images, tf.cast(tf.gather(self.labels, batch), tf.int32)


def test_batches(splits, rank=0, size=1, batch_size=1000):
    """``rank``'s share of the test set, a contiguous 1/``size`` of it: (images, labels) batches of
    ``batch_size`` examples."""
    share = streams.test_share(len(splits.x_test), rank, size)
    part = slice(share[0], share[-1] + 1) if len(share) else slice(0, 0)
    examples = tf.data.Dataset.from_tensor_slices((as_tensor(splits.x_test[part]), as_tensor(splits.y_test[part])))
    return streams.fixed_pipeline(examples.batch(batch_size).map(lambda x, y: (to_model_input(x), tf.cast(y, tf.int32)))
                                  .prefetch(2))


def as_tensor(array):
    """``array`` as a CPU tensor that shares its memory (through DLPack), after a copy into aligned
    memory unless it is there already (datasets reads into such): tf.constant would hold two more
    copies at once, which for a large training set decides whether it fits (docs/design.md, "One
    copy of the training set a node"). Neither may change while the other is in use."""
    if not (array.flags.c_contiguous and array.flags.writeable and array.ctypes.data % aligned.ALIGNMENT == 0):
        copy = aligned.empty(array.shape, array.dtype)
        copy[...] = array
        array = copy
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def to_model_input(images):
    """A batch of uint8 images, [b, h, w] (grayscale) or [b, h, w, c] -> float32 [b, h, w, c] in
    [0, 1]: what every model takes."""
    images = tf.cast(images, tf.float32) / 255.0
    return images[..., None] if images.shape.rank == 3 else images
