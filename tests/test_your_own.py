"""Your own model and data: the API (examples/custom_model.py), --model module:function, --data-dir x.npz."""
import subprocess

import numpy as np
import pytest

from conftest import PYTHON, ROOT, error_lines, launch, read_json, reported_accuracy, succeeded
from hvd_sgd import datasets, launchers


def test_the_example_trains_its_own_model_through_the_api():
    command = [launchers.venv_bin("horovodrun"), "-np", "2", PYTHON, "examples/custom_model.py"]
    result = succeeded(subprocess.run(command, cwd=ROOT, env=launchers.environment(), capture_output=True, text=True,
                                      timeout=240))
    assert "model small_cnn" in result.stdout
    assert reported_accuracy(result) > 0.85


def test_a_users_model_and_npz_data_from_the_command_line(tmp_path):
    """The example's model on MNIST shrunk to 14 x 14 pixels, saved as a user's .npz."""
    mnist = datasets.load("mnist")
    np.savez(tmp_path / "small.npz", x_train=mnist.x_train[:4096, ::2, ::2], y_train=mnist.y_train[:4096],
             x_test=mnist.x_test[:1000, ::2, ::2], y_test=mnist.y_test[:1000].astype(np.int64))
    metrics = tmp_path / "m.json"
    result = succeeded(launch("mpirun", 2, "--model", "examples.custom_model:small_cnn", "--data-dir",
                              tmp_path / "small.npz", "--epochs", 2, "--batch-size", 32, "--lr", "0.02",
                              "--metrics-file", metrics))
    assert reported_accuracy(result) > 0.85
    assert read_json(metrics)["steps"] == 2 * (4096 // 64)


@pytest.mark.parametrize("spec,message", [
    ("no_such_package.models:build", "--model no_such_package.models:build: cannot import module 'no_such_package.models'"),
    ("examples.custom_model:no_such_function", "module 'examples.custom_model' has no function 'no_such_function'"),
    ("operator:mul", "--model: mul returned tuple, not a Keras model"),
])
def test_a_bad_model_spec_is_one_line_naming_what_failed(spec, message):
    result = launch("mpirun", 2, "--model", spec, "--max-steps", 2, "--train-examples", 1000, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    [line] = error_lines(result)
    assert message in line, line
