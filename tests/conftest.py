"""Helpers that launch hvd_sgd the way users do (hvd_sgd.launchers), and make small IDX datasets."""
import gzip
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hvd_sgd import datasets, distributed, launchers

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
STACK = "current" if distributed.KERAS_3 else "default"  # the stack of this Python (run/lib.sh)
# Tagged output of the launchers: "[1,0]<stdout>:" (mpirun --tag-output), "[0]<stdout>:" (Gloo).
_TAG = re.compile(r"^\[[\d,]+\]<std(?:out|err)>:")


def launch(launcher, np_, *args, module="hvd_sgd.train", timeout=240, env=None, exits_dir=None, wrapper=()):
    """Run hvd_sgd under a real launcher; returns the CompletedProcess (text output).

    ``exits_dir``: mpirun only; every rank runs to its own end (mpirun does not kill the others
    when one fails) and writes its exit status to ``exits_dir/rank-N``.
    ``wrapper``: mpirun only; a command that each rank runs the program through
    (``sh -c '…; exec "$@"' sh``).
    """
    before = tuple(wrapper)
    if exits_dir is not None:
        assert launcher == "mpirun" and not wrapper
        before = ("--mca", "orte_abort_on_non_zero_status", "0", "sh", "-c",
                   f'"$@"; status=$?; echo $status > {exits_dir}/rank-$OMPI_COMM_WORLD_RANK; exit $status', "sh")
    command = launchers.command(launcher, np_, module, args, before_program=before)
    return subprocess.run(command, cwd=ROOT, env=launchers.environment(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)


def in_cgroup(cgroup, command):
    """``command`` run in the cgroup whose directory is ``cgroup`` (its children too)."""
    return ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *map(str, command)]


def rank_exits(exits_dir):
    return sorted(int(p.read_text()) for p in Path(exits_dir).iterdir())


def output_lines(text):
    return [_TAG.sub("", line) for line in text.splitlines() if _TAG.sub("", line).strip()]


def error_lines(result, prog="hvd_sgd.train"):
    return [line for line in output_lines(result.stderr) if f"{prog}: error:" in line]


def succeeded(result):
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    return result


def reported_accuracy(result):
    """The last line rank 0 printed must be 'Test accuracy: 0.XXXX'."""
    last = output_lines(result.stdout)[-1]
    match = re.fullmatch(r"Test accuracy: (\d\.\d{4})", last)
    assert match, f"last line is {last!r}"
    return float(match.group(1))


def read_json(path):
    with open(path) as f:
        return json.load(f)


def saved_weights(path):
    """Weights of a saved .keras model, read by plain TensorFlow."""
    import tensorflow as tf
    return [np.asarray(w) for w in tf.keras.models.load_model(path).get_weights()]


def train_and_save(tmp_path, name, launcher, np_, *args):
    """Train, save the model as ``tmp_path/name.keras``, return its weights."""
    path = tmp_path / f"{name}.keras"
    succeeded(launch(launcher, np_, *args, "--save-model", path))
    return saved_weights(path)


def assert_same_weights(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def max_difference(a, b):
    return max(np.abs(x - y).max() for x, y in zip(a, b, strict=True))


@pytest.fixture
def tiny_run():
    """Flags for a short run on a small MNIST subset."""
    return ["--train-examples", 2048, "--test-examples", 1000, "--log-every-steps", 10]


# --- small datasets in standard IDX files --------------------------------------------------------

def write_idx(path, array, magic=None, dims=None, cut=0, extra=b""):
    array = np.asarray(array, np.uint8)
    dims = array.shape if dims is None else dims
    raw = (magic or bytes([0, 0, 8, len(dims)])) + struct.pack(f">{len(dims)}I", *dims) + array.tobytes() + extra
    raw = raw[:len(raw) - cut]
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(raw)


def random_arrays(n_train=12, n_test=5, shape=(4, 4), seed=0):
    rng = np.random.default_rng(seed)
    return dict(x_train=rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
                y_train=rng.integers(0, 10, n_train, dtype=np.uint8),
                x_test=rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
                y_test=rng.integers(0, 10, n_test, dtype=np.uint8))


def write_dataset(directory, n_train=12, n_test=5, gz=True, **overrides):
    arrays = random_arrays(n_train, n_test)
    arrays.update(overrides)
    for key, (name, _) in datasets.IDX_FILES.items():
        write_idx(directory / (name + (".gz" if gz else "")), arrays[key])
    return arrays
