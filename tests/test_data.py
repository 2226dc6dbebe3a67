"""Unit tests: the rank-independent data order, IDX parsing and its bad inputs, the MNIST hash."""
import gzip
import struct

import numpy as np
import pytest

from hvd_sgd import JobError, data


def indices(n, batch, size, rank, first, last, seed=3):
    return data.rank_batch_indices(n, batch, size, rank, seed, first, last)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ranks_are_disjoint_and_cover_each_example_once_per_epoch(size):
    n, batch = 1000, 16
    per_epoch = data.steps_per_epoch(n, batch, size)
    shards = [indices(n, batch, size, r, 0, per_epoch) for r in range(size)]
    seen = np.concatenate([s.ravel() for s in shards])
    assert all(s.shape == (per_epoch, batch) for s in shards)  # every rank runs the same steps
    assert len(np.unique(seen)) == len(seen) == per_epoch * batch * size  # once each, nothing shared
    assert len(seen) > n - batch * size  # only the incomplete last global batch is dropped


def test_order_is_independent_of_the_number_of_ranks():
    """Step by step, N ranks with batch B see the examples one rank with batch N*B sees."""
    n, steps = 1000, 40  # several epochs
    one_rank = indices(n, 24, 1, 0, 0, steps)
    for size in (2, 3, 4):
        batch = 24 // size
        together = np.concatenate([indices(n, batch, size, r, 0, steps) for r in range(size)], axis=1)
        np.testing.assert_array_equal(together, one_rank)


def test_epochs_are_reshuffled_and_seeds_differ():
    first, second = data.epoch_order(500, 3, 0), data.epoch_order(500, 3, 1)
    assert not np.array_equal(first, second)
    assert sorted(first) == sorted(second) == list(range(500))
    assert not np.array_equal(first, data.epoch_order(500, 4, 0))


@pytest.mark.parametrize("first,last", [(0, 7), (5, 29), (10, 11), (19, 41)])
def test_a_resumed_run_continues_the_same_sequence(first, last):
    full = indices(640, 16, 2, 1, 0, 50)
    np.testing.assert_array_equal(indices(640, 16, 2, 1, first, last), full[first:last])


def test_no_full_step_is_a_clear_error():
    with pytest.raises(JobError, match="larger than a rank's shard"):
        data.steps_per_epoch(100, 60, 2)
    with pytest.raises(JobError, match="4 ranks but only 3 training examples"):
        data.steps_per_epoch(3, 1, 4)


# --- IDX files ---------------------------------------------------------------------------

def write_idx(path, array, magic=None, dims=None, cut=0, extra=b""):
    array = np.asarray(array, np.uint8)
    dims = array.shape if dims is None else dims
    raw = (magic or bytes([0, 0, 8, len(dims)])) + struct.pack(f">{len(dims)}I", *dims) + array.tobytes() + extra
    raw = raw[:len(raw) - cut]
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(raw)


def write_dataset(directory, n_train=12, n_test=5, gz=True, **overrides):
    rng = np.random.default_rng(0)
    arrays = dict(x_train=rng.integers(0, 256, (n_train, 4, 4)), y_train=rng.integers(0, 10, n_train),
                  x_test=rng.integers(0, 256, (n_test, 4, 4)), y_test=rng.integers(0, 10, n_test))
    arrays.update(overrides)
    for key, (name, _) in data.IDX_FILES.items():
        write_idx(directory / (name + (".gz" if gz else "")), arrays[key])
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_reads_standard_idx_files(tmp_path, gz):
    arrays = write_dataset(tmp_path, gz=gz)
    dataset = data.read_idx_dir(str(tmp_path), "custom")
    for key in data.IDX_FILES:
        np.testing.assert_array_equal(getattr(dataset, key), arrays[key])
    assert dataset.image_shape == (4, 4)


def test_installed_datasets_have_the_canonical_sizes():
    for name in ("mnist", "fashion_mnist"):
        d = data.load(name)
        assert (d.x_train.shape, d.x_test.shape) == ((60000, 28, 28), (10000, 28, 28))
        assert d.x_train.dtype == np.uint8 and set(np.unique(d.y_train)) == set(range(10))
    mnist = data.load("mnist")
    assert list(mnist.y_train[:5]) == [5, 0, 4, 1, 9] and list(mnist.y_test[:3]) == [7, 2, 1]


LABELS = "train-labels-idx1-ubyte.gz"
IMAGES = "train-images-idx3-ubyte.gz"


@pytest.mark.parametrize("damage,expected", [
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), magic=b"\x08\x03\x00\x00"), "bad magic number"),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), magic=b"\x00\x00\x0d\x03"), "is not unsigned byte"),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 16))), "expected 3 dimension"),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), cut=7), "truncated: "),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), extra=b"xx"), "has trailing bytes"),
    (lambda d: write_idx(d / LABELS, np.zeros(11)), "12 images but 11 labels"),
    (lambda d: write_idx(d / LABELS, np.full(12, 10)), "label 10 is out of range"),
    (lambda d: (d / LABELS).unlink(), "missing train-labels-idx1-ubyte"),
    (lambda d: write_idx(d / "t10k-images-idx3-ubyte.gz", np.zeros((5, 5, 5))), "train images are"),
    (lambda d: (d / IMAGES).write_bytes(gzip.compress(b"\0\0\x08\x03" + b"\0" * 100)[:-12]), "cannot read"),
    (lambda d: (d / IMAGES).write_bytes(b""), "cannot read|bad magic"),
])
def test_bad_idx_files_name_the_file_and_the_problem(tmp_path, damage, expected):
    write_dataset(tmp_path)
    damage(tmp_path)
    with pytest.raises(JobError, match=expected) as error:
        data.read_idx_dir(str(tmp_path), "custom")
    assert "\n" not in str(error.value) and str(tmp_path) in str(error.value)


def test_the_mnist_pickle_is_not_unpickled_unless_its_hash_matches():
    import pickle
    evil = pickle.dumps(("not", "mnist"))
    with pytest.raises(JobError, match="refusing to unpickle"):
        data._unpack_mnist_pickle(gzip.compress(evil), "x.pkl.gz")


def test_pipelines_yield_the_indexed_examples_and_run_without_the_autotuner(tmp_path):
    """Without tf.data's autotuner: its thread can hold up the iterator's deletion for seconds."""
    arrays = write_dataset(tmp_path)
    dataset = data.read_idx_dir(str(tmp_path), "custom")
    indices = np.array([[3, 1], [0, 7]])
    train = data.train_batches(dataset, indices)
    test = data.test_batches(dataset, batch_size=2)
    assert not train.options().autotune.enabled and not test.options().autotune.enabled
    for (images, labels), rows in zip(train, indices):
        np.testing.assert_allclose(images.numpy()[..., 0], arrays["x_train"][rows] / 255, rtol=1e-6)
        np.testing.assert_array_equal(labels.numpy(), arrays["y_train"][rows])
    test_labels = np.concatenate([labels.numpy() for _, labels in test])
    np.testing.assert_array_equal(test_labels, arrays["y_test"])
