"""Write a data set as an image-folder tree or as TFRecord shards, the layouts of users' sets on a
cluster (hvd_sgd.data.catalogs reads both); the tests make their data with it.

    python -m hvd_sgd.data export --format folder|tfrecord --from mnist|fashion_mnist|FILE.npz OUT

- folder: ``OUT/train/<class>/<n>.jpg`` and ``OUT/test/<class>/…``, the classes named by their labels,
  zero-padded so that sorting them keeps their order;
- tfrecord: ``OUT/train-00000-of-0000N`` and ``OUT/validation-…``, each record a ``tf.train.Example``
  with ``image/encoded``, ``image/class/label`` (the label as it is, from 0), ``image/height``,
  ``image/width``, ``image/channels`` and ``image/format``.
"""
import os

import numpy as np
import tensorflow as tf

from hvd_sgd import JobError

LAYOUTS = ("folder", "tfrecord")
IMAGE_FORMATS = ("jpeg", "png")


def export(splits, out, layout, image_size=None, colour=False, image_format="jpeg", shards=1):
    """Write ``splits`` (a datasets.Splits) under ``out``, one image at a time; the number of images written."""
    if os.path.exists(out) and os.listdir(out):
        raise JobError(f"{out}: not empty; export writes into a new directory")
    width = len(str(splits.num_classes - 1))
    written = 0
    for split, images, labels in (("train", splits.x_train, splits.y_train), ("test", splits.x_test, splits.y_test)):
        if layout == "folder":
            for n, image in enumerate(images):
                directory = os.path.join(out, split, str(int(labels[n])).zfill(width))
                os.makedirs(directory, exist_ok=True)
                data, _ = encoded(image, image_size, colour, image_format)
                with open(os.path.join(directory, f"{n:07d}.{'jpg' if image_format == 'jpeg' else 'png'}"), "wb") as f:
                    f.write(data)
        else:
            os.makedirs(out, exist_ok=True)
            name = "train" if split == "train" else "validation"
            for shard, part in enumerate(np.array_split(np.arange(len(labels)), shards)):
                with tf.io.TFRecordWriter(os.path.join(out, f"{name}-{shard:05d}-of-{shards:05d}")) as writer:
                    for i in part:
                        data, shape = encoded(images[i], image_size, colour, image_format)
                        writer.write(example(data, shape, int(labels[i]), image_format).SerializeToString())
        written += len(labels)
    return written


def encoded(image, image_size=None, colour=False, image_format="jpeg"):
    """An image (uint8 [h, w] or [h, w, c]) encoded, and its (height, width, channels): resized to
    ``image_size`` if given, grayscale made RGB if ``colour``."""
    image = tf.constant(image if image.ndim == 3 else image[..., None])
    if image_size and tuple(image.shape[:2]) != tuple(image_size):
        image = tf.cast(tf.round(tf.clip_by_value(tf.image.resize(image, image_size), 0, 255)), tf.uint8)
    if colour and image.shape[-1] == 1:
        image = tf.image.grayscale_to_rgb(image)
    encode = tf.io.encode_jpeg if image_format == "jpeg" else tf.io.encode_png
    return encode(image).numpy(), tuple(image.shape)


def example(data, shape, label, image_format):
    """The tf.train.Example of an encoded image of ``shape`` and its label, as ImageNet's scripts write it."""
    height, width, channels = shape

    def feature(value):
        if isinstance(value, bytes):
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))
    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": feature(data), "image/class/label": feature(label), "image/height": feature(height),
        "image/width": feature(width), "image/channels": feature(channels),
        "image/format": feature(image_format.upper().encode())}))
