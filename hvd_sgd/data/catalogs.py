"""Image sets on files, too large for memory: where each example's bytes are, and its label.

Two layouts, the two the field uses (numpy only; TensorFlow parses TFRecords' examples only):

- **image folders**: ``DIR/train/<class>/*.jpg`` and ``DIR/test/<class>/…`` (or ``val/``,
  ``validation/``), the layout of ImageNet and of Keras' ``image_dataset_from_directory``. Class
  names are sorted to labels, as Keras does; files are taken by extension, as Keras does.
- **TFRecord shards**: ``DIR/train-*`` and ``DIR/validation-*`` (or ``test-*``), or a glob of the
  training shards, each record a ``tf.train.Example`` holding the encoded image and its integer
  label (``image/encoded``, ``image/class/label``: TensorFlow's ImageNet scripts, Horovod's
  benchmarks and MLPerf).

A catalog is read once, by one rank, from an index kept beside the data (``.hvd_sgd-index/``, or
under the installation's cache where the data's directory is read-only) and built where it is
missing or no longer matches its files. Each example's image header is read then: its size and
channels, and whether the file is an image at all and whole, so that a broken file is named before
training. The catalog holds no image: a rank's memory does not grow with the set.
"""
import dataclasses
import glob
import hashlib
import os
import struct
from typing import Optional

import numpy as np

from hvd_sgd import JobError

IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")  # what Keras' image_dataset_from_directory takes
TEST_SPLITS = ("test", "val", "validation")
TFRECORD_FEATURES = ("image/encoded", "image/class/label")
INDEX_DIR = ".hvd_sgd-index"
INDEX_VERSION = 1
MAX_LABEL = 1 << 20


@dataclasses.dataclass(frozen=True)
class Catalog:
    """One split: example i's bytes are ``lengths[i]`` bytes at ``offsets[i]`` of ``files[file_of[i]]``
    (a whole image file, or a record of a shard), its label ``labels[i]``, its image (height, width,
    channels) ``shapes[i]``."""
    files: tuple
    file_of: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray
    shapes: np.ndarray

    def __len__(self):
        return len(self.labels)

    def name_of(self, example):
        """Where example ``example`` is, for a message: a file, or a shard and its record's offset."""
        path = self.files[self.file_of[example]]
        return path if self.offsets[example] == 0 and self.lengths[example] == _size(path) else \
            f"{path} (the record at byte {self.offsets[example]})"

    def head(self, n):
        """The first ``n`` examples (0 = all)."""
        if not n or n >= len(self):
            return self
        return dataclasses.replace(self, **{f: getattr(self, f)[:n] for f in
                                            ("file_of", "offsets", "lengths", "labels", "shapes")})


@dataclasses.dataclass(frozen=True)
class ImageSet:
    """A data set on files: its training and test catalogs, and how its images become model input."""
    name: str
    layout: str  # "folder" or "tfrecord"
    train: Catalog
    test: Catalog
    image_size: tuple  # (height, width) every image is resized to
    channels: int  # 1 or 3: every image is decoded to this many
    num_classes: int
    class_names: Optional[tuple] = None  # folders: the class of each label
    features: tuple = TFRECORD_FEATURES  # tfrecord: the image's and the label's feature names

    @property
    def input_shape(self):
        return (*self.image_size, self.channels)

    @property
    def num_train(self):
        return len(self.train)

    def subset(self, train_examples=0, test_examples=0):
        return dataclasses.replace(self, train=self.train.head(train_examples), test=self.test.head(test_examples))

    # The data interface (hvd_sgd.data), streamed by hvd_sgd.data.streams (TensorFlow, imported on
    # first use: the catalogs themselves are read and built without it).
    def step_batches(self, indices, threads=1, augmentation=None):
        from hvd_sgd.data import streams
        return streams.step_batches(self, indices, threads, augmentation)

    def test_batches(self, rank=0, size=1, threads=1):
        from hvd_sgd.data import streams
        return streams.test_batches(self, rank, size, threads)

    def undecodable_train(self, examples):
        from hvd_sgd.data import streams
        return streams.undecodable(self, self.train, examples)

    def undecodable_test(self, rank, size):
        from hvd_sgd.data import streams
        return streams.undecodable(self, self.test, streams.test_share(len(self.test), rank, size))


def detect(path):
    """The layout of ``--data-dir path``: "npz", "idx", "folder", "tfrecord"; None if none fits."""
    if path.endswith(".npz") and os.path.isfile(path):
        return "npz"
    if glob.has_magic(path):
        return "tfrecord"
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if os.path.isdir(os.path.join(path, "train")):
        return "folder"
    idx = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    if any(n.startswith(idx) for n in names):  # before shards: their names start with train- too
        return "idx"
    if any(n.startswith("train-") for n in names):
        return "tfrecord"
    return None


def open_set(path, image_size=None, features=TFRECORD_FEATURES, log=print):
    """The ImageSet at ``path`` (a folder tree, a directory of shards, or a glob of training shards)."""
    layout = detect(path)
    if layout == "folder":
        classes = _class_folders(os.path.join(path, "train"))
        test_dir = next((os.path.join(path, s) for s in TEST_SPLITS if os.path.isdir(os.path.join(path, s))), None)
        if test_dir is None:
            raise JobError(f"{path}: no test split: add test/ (or val/, validation/) beside train/, "
                           f"one folder a class, as in train/")
        test_classes = _class_folders(test_dir)
        unknown = sorted(set(test_classes) - set(classes))
        if unknown:
            raise JobError(f"{test_dir}: class folder(s) {', '.join(unknown)} are not in {path}/train")
        train, test = (_indexed(d, lambda d=d, c=classes, cs=cs: _folder_catalog(d, c, cs, log), _folder_stamp(d, cs), log)
                       for d, cs in ((os.path.join(path, "train"), classes), (test_dir, test_classes)))
        names = tuple(classes)
    elif layout == "tfrecord":
        train_shards, test_shards = _shards(path)
        train, test = (_tfrecord_catalog(shards, features, log) for shards in (train_shards, test_shards))
        names = None
    else:
        raise JobError(f"--data-dir {path}: neither a folder tree (train/<class>/…), TFRecord shards (train-*), "
                       f"IDX files nor an .npz")
    for split, catalog in (("train", train), ("test", test)):
        if len(catalog) == 0:
            raise JobError(f"{path}: the {split} split holds no image")
    shapes = np.concatenate([train.shapes, test.shapes])
    channels = 3 if shapes[:, 2].max() > 1 else 1
    if image_size is None:
        sizes = np.unique(shapes[:, :2], axis=0)
        if len(sizes) > 1:
            first, other = (train.shapes[0, :2], next(s for s in sizes if tuple(s) != tuple(train.shapes[0, :2])))
            raise JobError(f"{path}: the images differ in size ({first[0]}x{first[1]}, {other[0]}x{other[1]}, …): "
                           f"choose one with --image-size")
        image_size = tuple(int(n) for n in sizes[0])
    largest = int(max(train.labels.max(), test.labels.max()))
    if names and largest >= len(names):
        raise JobError(f"{path}: label {largest} has no class folder")
    return ImageSet(os.path.basename(os.path.normpath(path.split("*")[0])) or path, layout, train, test,
                    tuple(image_size), channels, len(names) if names else largest + 1, names, tuple(features))


# --- image folders ---------------------------------------------------------------------------

def _class_folders(directory):
    classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise JobError(f"{directory}: no class folders (it needs one folder a class, holding that class's images)")
    return classes


def _images_of(class_dir):
    """The image files of a class folder, sorted, and how many other files it holds."""
    names = sorted(os.listdir(class_dir))
    images = [n for n in names if n.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(class_dir, n))]
    return images, len(names) - len(images)


def _folder_stamp(directory, classes):
    """What the index of a split folder must match: every image's name, size and modification time."""
    stamp = hashlib.sha256()
    for c in classes:
        for name in _images_of(os.path.join(directory, c))[0]:
            info = os.stat(os.path.join(directory, c, name))
            stamp.update(f"{c}/{name}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return stamp.hexdigest()


def _folder_catalog(directory, classes, present, log):
    """``present``: the class folders of this split (a test split may lack some); labels follow ``classes``."""
    files, labels, skipped = [], [], 0
    for c in present:
        images, others = _images_of(os.path.join(directory, c))
        skipped += others
        if not images:
            raise JobError(f"{os.path.join(directory, c)}: empty class folder (no {'/'.join(IMAGE_EXTENSIONS)} file)")
        files += [os.path.join(directory, c, name) for name in images]
        labels += [classes.index(c)] * len(images)
    if skipped:
        log(f"{directory}: skipped {skipped} file(s) that are not images ({', '.join(IMAGE_EXTENSIONS)})")
    shapes = np.array([_image_header(path, _read_whole(path)) for path in files], np.int64).reshape(-1, 3)
    lengths = np.array([_size(path) for path in files], np.int64)
    return Catalog(tuple(files), np.arange(len(files), dtype=np.int64), np.zeros(len(files), np.int64), lengths,
                   np.array(labels, np.int64), shapes)


def _read_whole(path):
    """What the header check needs of an image file: its first and last bytes."""
    def read():
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            if len(head) == 1 << 16:
                f.seek(-16, os.SEEK_END)
                return head, f.read(16)
            return head, head[-16:]
    try:
        return read()
    except OSError as e:
        raise JobError(f"{path}: cannot read: {e.strerror}") from None


# --- TFRecord shards ---------------------------------------------------------------------------

def _shards(path):
    """(training shards, test shards): ``DIR/train-*`` and ``DIR/validation-*`` (or ``test-*``), or
    the glob ``path`` and the same glob with ``train`` as ``validation`` (or ``test``)."""
    pattern = path if glob.has_magic(path) else os.path.join(path, "train-*")
    train = sorted(glob.glob(pattern))
    if not train:
        raise JobError(f"--data-dir {path}: no TFRecord shards match {pattern}")
    if "train" not in os.path.basename(pattern):
        raise JobError(f"--data-dir {path}: the glob must name the training shards with 'train' in it, so that "
                       f"the test shards are found with 'validation' (or 'test') in its place")
    head, tail = os.path.split(pattern)
    for split in ("validation", "test"):
        test = sorted(glob.glob(os.path.join(head, tail.replace("train", split))))
        if test:
            return train, test
    raise JobError(f"--data-dir {path}: no test shards ({os.path.join(head, tail.replace('train', 'validation'))} "
                   f"or {tail.replace('train', 'test')})")


def _tfrecord_catalog(shards, features, log):
    parts = [_indexed(shard, lambda s=shard: _index_shard(s, features), _file_stamp(shard, features), log)
             for shard in shards]
    return Catalog(tuple(shards), np.concatenate([np.full(len(p), i, np.int64) for i, p in enumerate(parts)]),
                   *(np.concatenate([getattr(p, f) for p in parts]) for f in ("offsets", "lengths", "labels", "shapes")))


def _file_stamp(path, features):
    info = os.stat(path)
    return f"{info.st_size}\0{info.st_mtime_ns}\0{'/'.join(features)}"


def _index_shard(shard, features):
    """Every record of ``shard``: its data's offset and length (from the record headers: a uint64
    length, its CRC, the data, the data's CRC), its label and its image's header."""
    import tensorflow as tf  # parses tf.train.Example
    image_key, label_key = features
    offsets, lengths, labels, shapes = [], [], [], []
    size = _size(shard)
    with open(shard, "rb") as f:
        position = 0
        while position < size:
            header = f.read(12)
            if len(header) < 12:
                raise JobError(f"{shard}: truncated TFRecord (a record header cut at byte {position})")
            (length,) = struct.unpack("<Q", header[:8])
            if position + 12 + length + 4 > size:
                raise JobError(f"{shard}: truncated TFRecord (the record at byte {position} needs {length} bytes)")
            data = f.read(length)
            f.seek(4, os.SEEK_CUR)
            try:
                example = tf.train.Example.FromString(data).features.feature
            except Exception:  # protobuf's DecodeError
                raise JobError(f"{shard}: the record at byte {position} is not a tf.train.Example") from None
            for key, kind in ((image_key, "bytes_list"), (label_key, "int64_list")):
                if key not in example or len(getattr(example[key], kind).value) != 1:
                    have = ", ".join(sorted(example)) or "none"
                    raise JobError(f"{shard}: the record at byte {position} has no feature {key!r} of one "
                                   f"{kind.split('_')[0]} (it has {have}): name the features with --tfrecord-features")
            image = example[image_key].bytes_list.value[0]
            name = f"{shard} (the record at byte {position})"
            shapes.append(_image_header(name, (image[:1 << 16], image[-16:])))
            offsets.append(position + 12)
            lengths.append(length)
            labels.append(example[label_key].int64_list.value[0])
            if not 0 <= labels[-1] < MAX_LABEL:
                raise JobError(f"{name}: label {labels[-1]} is out of range 0..{MAX_LABEL - 1}")
            position += 12 + length + 4
    return Catalog((shard,), np.zeros(len(offsets), np.int64), np.array(offsets, np.int64),
                   np.array(lengths, np.int64), np.array(labels, np.int64), np.array(shapes, np.int64).reshape(-1, 3))


# --- indexes ---------------------------------------------------------------------------------

def _indexed(path, build, stamp, log):
    """The catalog of ``path`` from its index, or built and indexed when the index is missing or its
    stamp (the files' names, sizes and times) no longer matches."""
    index = _index_path(path)
    found = _read_index(index)
    if found is not None and found[0] == stamp:
        return found[1]
    if found is not None:
        log(f"{path}: its index no longer matches its files (changed since it was built): rebuilding it")
    catalog = build()
    _write_index(index, stamp, catalog)
    return catalog


def _index_path(path):
    """Beside the data where its directory is writable, else in the installation's cache."""
    path = os.path.abspath(path)
    beside = os.path.join(os.path.dirname(path), INDEX_DIR)
    name = os.path.basename(path) + ".npz"
    if os.access(os.path.dirname(path), os.W_OK) or os.access(beside, os.W_OK):
        return os.path.join(beside, name)
    from hvd_sgd.data import datasets
    return os.path.join(datasets.data_dir(), "index", hashlib.sha256(path.encode()).hexdigest()[:16] + "-" + name)


def _read_index(index):
    try:
        with np.load(index, allow_pickle=False) as z:
            if int(z["version"]) != INDEX_VERSION:
                return None
            files = tuple(str(f) for f in z["files"])
            return str(z["stamp"]), Catalog(files, *(z[f] for f in ("file_of", "offsets", "lengths", "labels",
                                                                    "shapes")))
    except (OSError, KeyError, ValueError):
        return None


def _write_index(index, stamp, catalog):
    """Atomically (another job may read it meanwhile); an index that cannot be written is rebuilt next time."""
    try:
        os.makedirs(os.path.dirname(index), exist_ok=True)
        tmp = f"{index}.{os.getpid()}.tmp.npz"
        np.savez(tmp, version=INDEX_VERSION, stamp=stamp, files=np.array(catalog.files, dtype=str),
                 **{f: getattr(catalog, f) for f in ("file_of", "offsets", "lengths", "labels", "shapes")})
        os.replace(tmp, index)
    except OSError:
        pass


# --- image headers ---------------------------------------------------------------------------

def _image_header(name, head_and_tail):
    """(height, width, channels) of an encoded image from its first bytes, checking that its last bytes
    end it (a truncated file does not): a JobError naming ``name`` otherwise."""
    head, tail = head_and_tail
    try:
        if head[:8] == b"\x89PNG\r\n\x1a\n":
            width, height, colour = struct.unpack(">II", head[16:24]) + (head[25],)
            if not tail.endswith(b"IEND\xaeB`\x82"):
                raise ValueError("truncated PNG (no IEND chunk at its end)")
            return height, width, 1 if colour in (0, 4) else 3
        if head[:2] == b"\xff\xd8":
            if not tail.rstrip(b"\0").endswith(b"\xff\xd9"):
                raise ValueError("truncated JPEG (no end-of-image marker at its end)")
            return _jpeg_size(head)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            width, height = struct.unpack("<HH", head[6:10])
            if not tail.endswith(b";"):
                raise ValueError("truncated GIF")
            return height, width, 3
        if head[:2] == b"BM":
            width, height = struct.unpack("<ii", head[18:26])
            (bits,) = struct.unpack("<H", head[28:30])
            return abs(height), width, 1 if bits == 8 else 3
    except (ValueError, struct.error, IndexError) as e:
        reason = str(e) if isinstance(e, ValueError) else "damaged header"
        raise JobError(f"{name}: {reason}") from None
    raise JobError(f"{name}: not a JPEG, PNG, GIF or BMP image (it starts {head[:8].hex() or 'empty'})")


def _jpeg_size(data):
    """Height, width, channels from a JPEG's frame header (SOF0-15 but DHT, JPG and DAC)."""
    position = 2
    while position + 9 < len(data):
        if data[position] != 0xFF:
            raise ValueError("damaged JPEG header")
        marker = data[position + 1]
        if marker == 0xFF:
            position += 1
            continue
        (length,) = struct.unpack(">H", data[position + 2:position + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width, components = struct.unpack(">HHB", data[position + 5:position + 10])
            return height, width, 1 if components == 1 else 3
        position += 2 + length
    raise ValueError("JPEG header without a frame (size) marker in its first 64 KiB")


def _size(path):
    return os.stat(path).st_size
