"""Your own model and data: the API (examples/custom_model.py), --model module:function, --data-dir x.npz."""
import os
import re
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from conftest import PYTHON, ROOT, Cgroup, error_lines, launch, peak_memory, read_json, reported_accuracy, succeeded
from hvd_sgd import JobError
from hvd_sgd.bench import launchers
from hvd_sgd.data import datasets, shared_data


@pytest.mark.slow
def test_the_example_trains_its_own_model_through_the_api():
    command = [launchers.venv_bin("horovodrun"), "-np", "2", PYTHON, "examples/custom_model.py"]
    result = succeeded(subprocess.run(command, cwd=ROOT, env=launchers.environment(), capture_output=True, text=True,
                                      timeout=240))
    assert "model small_cnn" in result.stdout
    assert reported_accuracy(result) > 0.85


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_users_data_sets_the_number_of_classes_in_both_programs(tmp_path):
    """Labels up to 11 (9 moved to 11: none is 9 or 10) on 14 x 14 images: the model gets 12
    outputs, and the TF1 program sizes its W and b from the data too."""
    mnist = datasets.load("mnist")
    relabel = lambda y: np.where(y == 9, 11, y)  # noqa: E731
    np.savez(tmp_path / "twelve.npz", x_train=mnist.x_train[:2048, ::2, ::2], y_train=relabel(mnist.y_train[:2048]),
             x_test=mnist.x_test[:1000, ::2, ::2], y_test=relabel(mnist.y_test[:1000]))
    data = ["--data-dir", tmp_path / "twelve.npz"]
    result = succeeded(launch("mpirun", 2, "--model", "softmax", *data, "--max-steps", 30,
                              "--save-model", tmp_path / "m.keras"))
    assert reported_accuracy(result) > 0.6
    assert tf.keras.models.load_model(tmp_path / "m.keras").output_shape == (None, 12)
    assert reported_accuracy(succeeded(launch("mpirun", 2, *data, "--steps", 30, "--lr", 0.5,
                                              module="hvd_sgd.train_v1"))) > 0.6


@pytest.mark.slow
def test_colour_images_train_in_both_programs(tmp_path):
    """Each 14 x 14 digit drawn in one of 3 colour channels, the class being that channel: only a
    model that sees the channels apart can tell the classes, and both programs must."""
    mnist, rng = datasets.load("mnist"), np.random.default_rng(0)

    def coloured(images):
        channel = rng.integers(0, 3, len(images))
        rgb = np.zeros((*images[:, ::2, ::2].shape, 3), np.uint8)
        rgb[np.arange(len(images)), ..., channel] = images[:, ::2, ::2]
        return rgb, channel
    (x_train, y_train), (x_test, y_test) = coloured(mnist.x_train[:2048]), coloured(mnist.x_test[:1000])
    np.savez(tmp_path / "rgb.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    data = ["--data-dir", tmp_path / "rgb.npz"]
    result = succeeded(launch("mpirun", 2, "--model", "softmax", *data, "--max-steps", 30,
                              "--save-model", tmp_path / "m.keras"))
    assert reported_accuracy(result) > 0.9
    assert tf.keras.models.load_model(tmp_path / "m.keras").input_shape == (None, 14, 14, 3)
    assert reported_accuracy(succeeded(launch("python", 1, *data, "--steps", 30, "--lr", 0.5,
                                              module="hvd_sgd.train_v1"))) > 0.9


@pytest.mark.slow
def test_the_ranks_of_a_node_hold_one_copy_of_the_training_set(tmp_path):
    """Each rank held three copies of it at its peak (TensorFlow's conversion of a numpy array),
    so two ranks on a 205-MB .npz grew by 604 MB each over a 1000-image one; now the node's
    first rank reads it into shared memory, and the job as a whole grows by its size."""
    images = np.full((200_000, 32, 32), 7, np.uint8)  # 205 MB
    labels = np.arange(200_000) % 10
    np.savez(tmp_path / "large.npz", x_train=images, y_train=labels, x_test=images[:100], y_test=labels[:100])
    np.savez(tmp_path / "small.npz", x_train=images[:1000], y_train=labels[:1000], x_test=images[:100],
             y_test=labels[:100])
    in_cgroup = Cgroup.unusable("memory") is None  # the job's peak needs one; a rank's does not
    (large_rank, large_job), (small_rank, small_job) = (peak_memory(tmp_path / f"{size}.npz", job=in_cgroup)
                                                        for size in ("large", "small"))
    # A rank's own peak counts the shared pages it reads, so it grows by the set's size (before: three
    # copies); the job decides whether the ranks share one (a copy each: 2 x 205 MB more, measured 2.03 x).
    assert large_rank - small_rank < 1.3 * images.nbytes, f"a rank: {(large_rank - small_rank) / 1e6:.0f} MB more"
    if in_cgroup:
        assert large_job - small_job < 1.4 * images.nbytes, f"the job: {(large_job - small_job) / 1e6:.0f} MB more"


@pytest.mark.slow
def test_a_dev_shm_too_small_for_the_training_set_gives_each_rank_its_own_copy(tmp_path):
    """Docker's /dev/shm holds 64 MB unless told otherwise, and writing past its end would kill
    the reading rank (SIGBUS): the node's ranks each read their own copy of 94 MB instead."""
    if os.geteuid() != 0:
        pytest.skip("a /dev/shm of its own needs root (a mount namespace)")
    mnist = datasets.load("mnist")
    np.savez(tmp_path / "twice.npz", x_train=np.concatenate([mnist.x_train] * 2),
             y_train=np.concatenate([mnist.y_train] * 2), x_test=mnist.x_test[:1000], y_test=mnist.y_test[:1000])
    small_shm = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]
    softmax = ["--model", "softmax", "--data-dir", tmp_path / "twice.npz", "--max-steps", 30]
    command = launchers.command("mpirun", 2, "hvd_sgd.train", softmax)
    result = succeeded(subprocess.run(small_shm + command, cwd=ROOT, env=launchers.environment(), capture_output=True,
                                      text=True, timeout=240))
    assert reported_accuracy(result) > 0.6


@pytest.mark.slow
def test_shared_files_left_by_a_killed_job_are_removed_by_the_next():
    """A rank killed while it reads leaves its files in /dev/shm (memory, until the node reboots);
    the next job's reader removes those whose process is gone, and no one else's."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead, live = (os.path.join(shared_data.SHARED_MEMORY, f"{shared_data.PREFIX}{pid}-0")
                  for pid in (ended.pid, os.getpid()))
    for path in (dead, live):
        open(path, "wb").close()
    try:
        shared_data.remove_stale()
        assert not os.path.exists(dead) and os.path.exists(live)
    finally:
        for path in (dead, live):
            if os.path.exists(path):
                os.unlink(path)


BATCH_NORM_MODEL = """
import tensorflow as tf


def model(input_shape, num_classes):
    return tf.keras.Sequential([
        tf.keras.Input(input_shape),
        tf.keras.layers.Conv2D(8, 3, activation="relu"),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(num_classes),
    ])
"""


@pytest.mark.slow
@pytest.mark.both_stacks  # Keras 3's variables have dtypes of their own
def test_a_model_with_batch_normalization_ends_with_the_ranks_statistics_averaged(tmp_path):
    """Each rank moves BatchNormalization's statistics with its own batches: the ranks ended
    holding different weights, and the job failed after training ('ranks hold different weights
    at the end'). Every evaluation now averages them first, so the ranks end identical."""
    (tmp_path / "batch_norm.py").write_text(BATCH_NORM_MODEL)
    mnist = datasets.load("mnist")
    np.savez(tmp_path / "small.npz", x_train=mnist.x_train[:2048, ::2, ::2], y_train=mnist.y_train[:2048],
             x_test=mnist.x_test[:500, ::2, ::2], y_test=mnist.y_test[:500])
    model = tmp_path / "m.keras"
    result = succeeded(launch("mpirun", 2, "--model", "batch_norm:model", "--data-dir", tmp_path / "small.npz",
                              "--epochs", 2, "--batch-size", 32, "--save-model", model,
                              env={"PYTHONPATH": str(tmp_path)}))
    assert reported_accuracy(result) > 0.6  # chance is 0.1; 0.79 measured
    moving_mean = next(v for v in tf.keras.models.load_model(model).non_trainable_variables if "moving_mean" in v.name)
    assert np.abs(moving_mean.numpy()).max() > 0  # the statistics did move


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.both_stacks  # Keras 3 builds, wraps errors and names classes otherwise
def test_a_subclassed_model_trains_and_save_model_refuses_it_before_training(tmp_path):
    """Its weights exist once hvd_sgd has called it on a batch, so they are broadcast and trained."""
    spec, run = "examples.custom_model:small_cnn_subclassed", ["--max-steps", 40, "--train-examples", 2048]
    assert reported_accuracy(succeeded(launch("mpirun", 2, "--model", spec, *run))) > 0.6
    refused = launch("mpirun", 2, "--model", spec, *run, "--save-model", tmp_path / "m.keras", timeout=120)
    [line] = error_lines(refused)
    assert "--save-model" in line and "SmallCNN is a subclassed Keras model" in line, line
    assert "Traceback" not in refused.stderr and "step " not in refused.stdout  # nothing trained, nothing lost


def raises(input_shape, num_classes):
    raise ValueError("a bug in the user's code")


def five_outputs(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(), tf.keras.layers.Dense(5)])


def flat_input(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.Input((784,)), tf.keras.layers.Dense(num_classes)])


class ReshapesTo783(tf.keras.Model):
    def __init__(self, num_classes):
        super().__init__()
        self.logits = tf.keras.layers.Dense(num_classes)

    def call(self, images):
        return self.logits(tf.reshape(images, [-1, 783]))


def reshapes_to_783(input_shape, num_classes):
    return ReshapesTo783(num_classes)


@pytest.mark.both_stacks  # Keras 3 builds, wraps errors and names classes otherwise
@pytest.mark.parametrize("model_fn,message", [
    (raises, rf"--model: raises raised ValueError: a bug in the user's code \({__file__}, line \d+\)$"),
    (five_outputs, r"--model: five_outputs's model gives an output of shape \(5,\) for an image, not 10 logits$"),
    (flat_input, r"--model: flat_input's model takes inputs of shape \(784,\), not images of shape \(28, 28, 1\)$"),
    (reshapes_to_783, r"--model: reshapes_to_783's model cannot take images of shape \(28, 28, 1\): "
                      rf"InvalidArgumentError: .*783.* \({__file__}, line \d+\)$"),
])
def test_a_model_that_breaks_the_contract_is_one_line_naming_it(model_fn, message):
    from hvd_sgd.training import models
    with pytest.raises(JobError) as error:
        models.build(model_fn, (28, 28, 1), 10, seed=1)
    assert re.match(message, str(error.value)) and "\n" not in str(error.value), str(error.value)
