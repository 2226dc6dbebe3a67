"""What tells the two stacks apart, and what holds on both (docs/design.md, "Two stacks"); that a
wrapped Keras optimizer averages the ranks' gradients on either is test_horovod_api.py's. The tests
marked both_stacks run on each stack."""
import subprocess

import numpy as np
import pytest

from conftest import PYTHON, ROOT, STACK, error_lines, launch, succeeded

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.mark.both_stacks
@pytest.mark.skipif(STACK != "current", reason="Keras 2: Horovod 0.28.1 as released, which does not check")
def test_an_optimizer_wrapped_twice_is_refused_in_one_line():
    code = ("import tensorflow as tf, horovod.tensorflow as hvd\nfrom hvd_sgd.training import distributed\n"
            "distributed.DistributedOptimizer(hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), hvd.Compression.none)")
    result = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "already a Horovod DistributedOptimizer" in result.stderr.splitlines()[-1], \
        result.stderr[-2000:]


@pytest.mark.both_stacks
def test_elastic_mode_outside_horovodruns_elastic_launch_is_refused_in_one_line(tiny_run):
    result = launch("python", 1, "--elastic", "--max-steps", 1, *tiny_run)
    [line] = error_lines(result)
    assert result.returncode == 1 and "--elastic needs horovodrun's elastic" in line and "Traceback" not in result.stderr, \
        result.stderr[-2000:]


# A model with batch normalization: hvd_sgd.SyncBatchNormalization (either stack) or Keras' own, not
# fused under Keras 2 (its fused kernel rounds otherwise: 4e-4 apart after 3 steps on 1 rank).
NORMALIZED = """
import tensorflow as tf
import hvd_sgd
from hvd_sgd.training import distributed

def model(normalization):
    def build(input_shape, num_classes):
        return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Conv2D(8, 3), normalization(),
                                    tf.keras.layers.ReLU(), tf.keras.layers.Flatten(),
                                    tf.keras.layers.Dense(num_classes, name="logits")])
    return build

synchronized = model(hvd_sgd.SyncBatchNormalization)
plain = model(tf.keras.layers.BatchNormalization if distributed.KERAS_3 else
              lambda: tf.keras.layers.BatchNormalization(fused=False))
"""


@pytest.mark.both_stacks
def test_synchronized_batch_normalization_on_two_ranks_trains_like_one_rank_with_the_global_batch(tmp_path):
    """2 ranks x 16 with SyncBatchNormalization: the batch statistics, the moving ones and the weights of
    1 rank x 32 with Keras' plain layer, to rounding (measured 5e-5 after 3 steps); 2 ranks x 16 with
    the plain layer, each rank normalising with its own statistics, differ (1.4e-2: the control). The
    synchronized model is saved with a plain BatchNormalization, which plain TensorFlow loads."""
    import tensorflow as tf
    (tmp_path / "normalized.py").write_text(NORMALIZED)
    common = ["--lr", "0.05", "--no-lr-scaling", "--train-examples", 640, "--test-examples", 500, "--max-steps", 3,
              "--seed", 4]
    env = {"PYTHONPATH": str(tmp_path)}
    runs = {}
    for name, launcher, np_, model, batch in (("one", "python", 1, "plain", 32), ("synced", "mpirun", 2, "synchronized", 16),
                                              ("apart", "mpirun", 2, "plain", 16)):
        path = tmp_path / f"{name}.keras"
        succeeded(launch(launcher, np_, "--model", f"normalized:{model}", *common, "--batch-size", batch,
                         "--save-model", path, env=env))
        loaded = tf.keras.models.load_model(path)
        assert [type(layer).__name__ for layer in loaded.layers][1] == "BatchNormalization"
        runs[name] = [w.numpy() for w in loaded.weights]
    for synced, one in zip(runs["synced"], runs["one"]):
        np.testing.assert_allclose(synced, one, rtol=0, atol=2e-4)
    assert max(np.abs(a - b).max() for a, b in zip(runs["apart"], runs["one"])) > 2e-3
