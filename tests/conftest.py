"""Helpers that launch hvd_sgd the way users do: plain python, mpirun, horovodrun (MPI or Gloo)."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent
LAUNCHERS = ("python", "mpirun", "horovodrun", "horovodrun-gloo")
# Tagged output of the launchers: "[1,0]<stdout>:" (mpirun --tag-output), "[0]<stdout>:" (Gloo).
_TAG = re.compile(r"^\[[\d,]+\]<std(?:out|err)>:")


def launch_command(launcher, np_, module, args):
    program = [PYTHON, "-m", module, *map(str, args)]
    if launcher == "python":
        assert np_ == 1
        return program
    if launcher == "mpirun":
        return [shutil.which("mpirun"), "-np", str(np_), "--oversubscribe", *program]
    gloo = ["--gloo"] if launcher == "horovodrun-gloo" else []
    return [str(BIN / "horovodrun"), "-np", str(np_), *gloo, *program]


def launch(launcher, np_, *args, module="hvd_sgd.train", timeout=240, env=None):
    """Run hvd_sgd under a real launcher; returns the CompletedProcess (text output)."""
    environment = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                       PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(launch_command(launcher, np_, module, args), cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def output_lines(text):
    return [_TAG.sub("", line) for line in text.splitlines() if _TAG.sub("", line).strip()]


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


@pytest.fixture
def tiny_run():
    """Flags for a short run on a small MNIST subset."""
    return ["--train-examples", 2048, "--test-examples", 1000, "--log-every-steps", 10]
