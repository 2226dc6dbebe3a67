"""Batches streamed from an image set's files (hvd_sgd.data.catalogs), in the data order of hvd_sgd.data.batches.

A rank reads only the examples of its own next batches, reads and decodes them on as many parallel
calls as it has cores, and holds at most PREFETCH_BATCHES decoded batches ahead of its step: its
memory does not grow with the set. Every example is decoded, resized and augmented alone, from
its bytes and (seed, epoch, example) only, so a batch is the same whichever rank builds it.
"""
import os
import re
import threading

import numpy as np
import tensorflow as tf

from hvd_sgd import first_line
from hvd_sgd.data import augment

PREFETCH_BATCHES = 2
TEST_BATCH = 256  # decoded images of an evaluation batch


def step_batches(image_set, indices, threads, augmentation=None):
    """For a compiled step: a function whose every call (inside the step) gives the batch of the next
    row of ``indices`` [steps, rank batch]: (images float32 [B, h, w, c] in [0, 1], labels int32 [B]).
    ``augmentation``: (flip, dy, dx) arrays of the shape of ``indices``, or None."""
    examples = tf.data.Dataset.from_tensor_slices(_per_example(indices, augmentation))
    batches = examples.map(_loader(image_set, image_set.train, augmentation is not None),
                           num_parallel_calls=threads, deterministic=True)
    iterator = iter(fixed_pipeline(batches.batch(indices.shape[1], drop_remainder=True).prefetch(PREFETCH_BATCHES), threads))
    return iterator.get_next


def test_batches(image_set, rank=0, size=1, threads=1):
    """``rank``'s share of the test set, as (images, labels) batches."""
    examples = tf.data.Dataset.from_tensor_slices(_per_example(test_share(len(image_set.test), rank, size)[None], None))
    batches = examples.map(_loader(image_set, image_set.test, False), num_parallel_calls=threads, deterministic=True)
    return fixed_pipeline(batches.batch(TEST_BATCH).prefetch(PREFETCH_BATCHES), threads)


def test_share(examples, rank, size):
    """The test examples ``rank`` of ``size`` evaluates: a contiguous 1/``size`` of them."""
    return np.array_split(np.arange(examples), size)[rank]


def undecodable(image_set, catalog, examples):
    """Which of ``examples`` of ``catalog`` (the set's train or test) does not read or decode: one
    line naming the first, or None if all do."""
    load = _loader(image_set, catalog, False)
    for example in np.asarray(examples).reshape(-1):
        try:
            load(dict(example=tf.constant(example, tf.int64)))
        except tf.errors.OpError as e:
            return f"{catalog.name_of(example)}: cannot read or decode the image: {_tensorflow_message(e)}"
    return None


def _tensorflow_message(error):
    """An op's error as its message alone, without the function and op TensorFlow wraps it in."""
    return re.sub(r"\{\{.*?\}\}\s*|\s*\[Op:.*$", "", first_line(error, limit=None)).strip()


def _per_example(indices, augmentation):
    columns = dict(example=indices.reshape(-1))
    if augmentation is not None:
        columns.update(zip(("flip", "dy", "dx"), (a.reshape(-1) for a in augmentation)))
    return columns


def fixed_pipeline(pipeline, threads=None):
    """``pipeline`` with the parallelism it was given, on ``threads`` of its own if given, and without
    tf.data's autotuner: its thread can hold up the iterator's deletion for seconds in TensorFlow
    2.15 (docs/design.md, "The step")."""
    options = tf.data.Options()
    options.autotune.enabled = False
    if threads:
        options.threading.private_threadpool_size = threads
    return pipeline.with_options(options)


def _loader(image_set, catalog, augmented):
    """The function of a tf.data map: an example's row -> (image float32 [h, w, c] in [0, 1], label)."""
    labels = tf.constant(catalog.labels, tf.int32)
    if image_set.layout == "folder":
        paths = tf.constant(catalog.files)

        def encoded(example):
            return tf.io.read_file(tf.gather(paths, example))
    else:
        read = _RecordReader(catalog)
        image_key = image_set.features[0]

        def encoded(example):
            record = tf.numpy_function(read, [example], tf.string, stateful=False)
            return tf.io.parse_single_example(record, {image_key: tf.io.FixedLenFeature([], tf.string)})[image_key]

    height, width = image_set.image_size

    def load(row):
        image = tf.io.decode_image(encoded(row["example"]), channels=image_set.channels, expand_animations=False)
        image = tf.ensure_shape(image, [None, None, image_set.channels])
        image = tf.image.resize(image, (height, width)) if _resized(image_set, catalog) else tf.cast(image, tf.float32)
        image = tf.ensure_shape(image / 255.0, (height, width, image_set.channels))
        if augmented:
            image = augment.padded_crop_and_flip(image, row["flip"], row["dy"], row["dx"])
        return image, tf.gather(labels, row["example"])

    return load


def _resized(image_set, catalog):
    return bool((catalog.shapes[:, :2] != image_set.image_size).any())


class _RecordReader:
    """Reads example i's record data from its shard (pread: any thread, any order)."""

    def __init__(self, catalog):
        self.catalog, self.files, self.lock = catalog, {}, threading.Lock()

    def __call__(self, example):
        c = self.catalog
        shard = int(c.file_of[example])
        with self.lock:
            if shard not in self.files:
                self.files[shard] = os.open(c.files[shard], os.O_RDONLY)
        data = os.pread(self.files[shard], int(c.lengths[example]), int(c.offsets[example]))
        if len(data) != c.lengths[example]:
            raise OSError(f"{c.files[shard]}: truncated since it was indexed")
        return data
