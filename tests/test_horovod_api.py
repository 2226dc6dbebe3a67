"""Horovod's TensorFlow and Keras API as a user's own script calls it, on the installation's
patched Horovod, on either stack: under Keras 3 its wrapper, tape and callbacks are hvd_sgd's patch
(run/patches/horovod-0.28.1-keras-3.patch). Horovod's three TF2 MNIST examples (tests/horovod/examples,
v0.28.1, only their data loading, step counts and what Keras 3 removed changed) under horovodrun
on the current stack, and small scripts whose weights after one step are known exactly."""
import json
import subprocess

import pytest

from conftest import PYTHON, ROOT, STACK, output_lines, succeeded
from hvd_sgd.bench import launchers

pytestmark = [pytest.mark.both_stacks, pytest.mark.slow]
EXAMPLES = ROOT / "tests" / "horovod" / "examples"

# Runs an example unchanged (as __main__), keeping the Keras models it builds; then every rank's
# CRC of the last model's weights, and rank 0's accuracy on the MNIST test set.
OBSERVED = """
import json, runpy, sys, zlib
import tensorflow as tf
models = []
build = tf.keras.Sequential.__init__
def kept(self, *args, **kwargs):
    models.append(self)
    build(self, *args, **kwargs)
tf.keras.Sequential.__init__ = kept
example = sys.argv[1]
sys.argv = [example]
runpy.run_path(example, run_name="__main__")
import horovod.tensorflow as hvd
import hvd_sgd.data.datasets
model = models[-1]
crcs = hvd.allgather_object(zlib.crc32(b"".join(w.tobytes() for w in model.get_weights())))
if hvd.rank() == 0:
    _, (x_test, y_test) = hvd_sgd.data.datasets.load_data("mnist")
    probabilities = model.predict(x_test[..., None] / 255.0, batch_size=1000, verbose=0)
    print("OBSERVED " + json.dumps(dict(crcs=crcs, accuracy=float((probabilities.argmax(1) == y_test).mean()))))
"""
# Each example's test accuracy after its shortened run, on either stack (benchmarks/notes/2026-12-07-zen3.md),
# less a margin for the noise of a run's shuffle and initial weights.
ACCURACY_AT_LEAST = 0.85


def observed(lines):
    """The OBSERVED object (Keras' progress bar may go on after it on the same line)."""
    line = next(line for line in lines if line.startswith("OBSERVED "))
    return json.JSONDecoder().raw_decode(line[len("OBSERVED "):])[0]


@pytest.mark.skipif(STACK == "keras2", reason="Keras 2: Horovod 0.28.1 as released, on the Keras its examples "
                    "were written for; its averaging and broadcast callback are checked below")
@pytest.mark.parametrize("example,elastic", [
    ("tensorflow2_keras_mnist.py", False),  # DistributedOptimizer, the three callbacks, Adam, fit
    ("tensorflow2_mnist.py", False),  # DistributedGradientTape, broadcast_variables (horovod#4290)
    ("tensorflow2_keras_mnist_elastic.py", True),  # KerasState and the elastic callbacks
])
def test_horovods_example_trains_the_ranks_alike(example, elastic, tmp_path):
    elastic_options = ["--min-np", "2", "--max-np", "2", "--host-discovery-script", ROOT / "run" / "discover-hosts"]
    command = [launchers.venv_bin("horovodrun"), "-np", "2", *(elastic_options if elastic else []),
               PYTHON, "-c", OBSERVED, EXAMPLES / example]
    result = succeeded(subprocess.run(list(map(str, command)), cwd=tmp_path, env=launchers.environment(),
                                      capture_output=True, text=True, timeout=600))
    seen = observed(output_lines(result.stdout))
    assert len(set(seen["crcs"])) == 1, f"the ranks' weights differ: {seen['crcs']}"
    assert seen["accuracy"] >= ACCURACY_AT_LEAST, seen


# One weight w = 0 and the mean absolute error |w x - 100|, whose gradient is -x: rank r's x is
# r + 1 (or rank 1's is x1), so at learning rate 1 its own step gives w = r + 1 and the average
# step w = 1.5. Each case, in one launch: wrap (horovod: Horovod's DistributedOptimizer, the default;
# hvd_sgd: hvd_sgd's, which fit uses; plain: none, the control), sgd (SGD's keyword arguments), horovod
# (DistributedOptimizer's), loss_scale, steps, x1. Prints, for each case, every rank's w and loss scale.
ONE_WEIGHT = """
import json, sys
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
from hvd_sgd.training import distributed
hvd.init()
WRAPS = dict(horovod=hvd.DistributedOptimizer, plain=lambda optimizer: optimizer,
             hvd_sgd=lambda optimizer, **kw: distributed.DistributedOptimizer(optimizer, hvd.Compression.none, **kw))
results = []
for case in json.loads(sys.argv[1]):
    x = [1.0, case.get("x1", 2.0)][hvd.rank()]
    model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    optimizer = tf.keras.optimizers.SGD(1.0, **case.get("sgd", {}))
    if case.get("loss_scale"):
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    model.compile(optimizer=WRAPS[case.get("wrap", "horovod")](optimizer, **case.get("horovod", {})), loss="mae")
    steps = case.get("steps", 1)
    # Horovod's broadcast callback acts after the first batch: the control, unwrapped, goes without it.
    broadcast = [] if case.get("wrap") == "plain" else [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    model.fit(np.full((steps, 1), x), np.full((steps, 1), 100.0), batch_size=1, verbose=0, callbacks=broadcast)
    scale = float(model.optimizer.dynamic_scale) if case.get("loss_scale") else None
    results.append(hvd_tf.allgather_object([float(model.get_weights()[0][0, 0]), scale]))
if hvd.rank() == 0:
    print(json.dumps(results))
"""
AVERAGES = [
    (dict(), [1.5, 1.5]),  # the average of the ranks' steps, 1 and 2
    (dict(wrap="hvd_sgd"), [1.5, 1.5]),  # hvd_sgd's wrapper: Horovod's
    (dict(wrap="plain"), [1.0, 2.0]),  # the control: each rank applies its own gradient
    # Accumulated over two passes: their sum (Horovod's default), or their mean.
    (dict(steps=2, horovod=dict(backward_passes_per_step=2)), [3.0, 3.0]),
    (dict(steps=2, horovod=dict(backward_passes_per_step=2, average_aggregated_gradients=True)), [1.5, 1.5]),
    # Keras clips the average (1.5 to 1.4), not each rank's gradient (which would give 1.2).
    (dict(sgd=dict(clipvalue=1.4)), [1.4, 1.4]),
]
# Keras 3 only (Horovod 0.28.1 cannot wrap Keras 2's LossScaleOptimizer; hvd_sgd wraps its inner one
# there): rank 1's gradient overflows, then none does.
LOSS_SCALED = [dict(loss_scale=True, x1=float("inf")), dict(loss_scale=True)]


@pytest.fixture(scope="module")
def one_weight():
    """Each case's [[w, scale] of rank 0, of rank 1], from one launch of 2 ranks."""
    cases = [case for case, _ in AVERAGES] + (LOSS_SCALED if STACK == "current" else [])
    result = succeeded(subprocess.run([launchers.mpirun(), "-np", "2", PYTHON, "-c", ONE_WEIGHT, json.dumps(cases)],
                                      cwd=ROOT, env=launchers.environment(), capture_output=True, text=True, timeout=300))
    return dict(zip(map(json.dumps, cases), json.loads(output_lines(result.stdout)[-1])))


@pytest.mark.parametrize("case,weights", AVERAGES)
def test_the_wrapped_keras_optimizer_applies_the_ranks_average(one_weight, case, weights):
    assert [w for w, _ in one_weight[json.dumps(case)]] == pytest.approx(weights)


@pytest.mark.skipif(STACK == "keras2", reason="Keras 2: Horovod 0.28.1 cannot wrap a LossScaleOptimizer "
                                               "(hvd_sgd wraps its inner optimizer there)")
def test_a_loss_scale_optimizer_skips_a_step_on_every_rank_when_one_rank_overflows(one_weight):
    """Rank 1's gradient is not finite: both ranks skip the step and halve the scale alike (a rank
    that applied its step alone would wait for the other's all-reduce for ever)."""
    overflowed, clean = (one_weight[json.dumps(case)] for case in LOSS_SCALED)
    assert [w for w, _ in overflowed] == [0.0, 0.0] and overflowed[0][1] == overflowed[1][1] == clean[0][1] / 2
    assert [w for w, _ in clean] == pytest.approx([1.5, 1.5])


# hvd.load_model: rank 0 saves a compiled one-weight model (w = 0, SGD at 1, as ONE_WEIGHT), every
# rank loads it with Horovod's optimizer and takes one step on its own x = rank + 1: w = 1.5 on both.
LOADED = """
import json, sys
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
hvd.init()
path = sys.argv[1]
if hvd.rank() == 0:
    model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss="mae")
    model.save(path)
hvd_tf.broadcast_object(path, root_rank=0)  # the others wait for rank 0 to have saved it
model = hvd.load_model(path)
model.fit(np.full((1, 1), hvd.rank() + 1.0), np.full((1, 1), 100.0), batch_size=1, verbose=0)
weights = hvd_tf.allgather_object(float(model.get_weights()[0][0, 0]))
if hvd.rank() == 0:
    print(json.dumps(weights))
"""


@pytest.mark.skipif(STACK == "keras2", reason="Keras 2: Horovod 0.28.1 as released, whose load_model of a .keras "
                                               "file gives a plain optimizer: [1.0, 2.0], unaveraged (2026-12-07)")
def test_a_model_loaded_with_hvd_load_model_trains_on_the_average(tmp_path):
    result = succeeded(subprocess.run([launchers.mpirun(), "-np", "2", PYTHON, "-c", LOADED, tmp_path / "m.keras"],
                                      cwd=ROOT, env=launchers.environment(), capture_output=True, text=True, timeout=180))
    assert json.loads(output_lines(result.stdout)[-1]) == pytest.approx([1.5, 1.5])


# The script: Horovod's documented Keras recipe, each rank fitting its own slice of MNIST.
PER_RANK_DATA = """
import zlib
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import hvd_sgd.data.datasets
hvd.init()
(x, y), _ = hvd_sgd.data.datasets.load_data("mnist")
mine = slice(hvd.rank() * 2048, (hvd.rank() + 1) * 2048)
model = tf.keras.Sequential([tf.keras.Input((28, 28)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x[mine] / 255.0, y[mine], batch_size=64, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
crcs = hvd_tf.allgather_object(zlib.crc32(b"".join(w.tobytes() for w in model.get_weights())))
if hvd.rank() == 0:
    print("CRCS " + str(crcs))
"""


def test_horovods_keras_recipe_on_per_rank_data_ends_with_the_same_weights():
    result = succeeded(subprocess.run([launchers.venv_bin("horovodrun"), "-np", "2", PYTHON, "-c", PER_RANK_DATA],
                                      cwd=ROOT, env=launchers.environment(), capture_output=True, text=True, timeout=300))
    [line] = [line for line in output_lines(result.stdout) if line.startswith("CRCS")]
    crcs = json.loads(line.split(" ", 1)[1])
    assert len(crcs) == 2 and crcs[0] == crcs[1], crcs


# What Keras 3 cannot do, each run in turn in one process: the exception each raises.
REFUSED = """
import json, sys
import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd
hvd.init()
errors = []
for code in json.loads(sys.argv[1]):
    try:
        exec(code)
        errors.append(None)
    except Exception as error:
        errors.append(f"{type(error).__name__}: {error}")
print(json.dumps(errors))
"""
CANNOT = [
    ("hvd.DistributedOptimizer(hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))", "already"),
    ("hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))", "not a Keras 3 optimizer"),
    ("hvd.load_model('model.keras', legacy_opts=True)", "legacy"),
    ("m = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])\n"
     "m.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9)), loss='mse')\n"
     "m.fit(np.ones((1, 1)), np.ones((1, 1)), verbose=0, callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1)])",
     "momentum_correction=False"),
]


@pytest.mark.skipif(STACK == "keras2", reason="Keras 2: Horovod 0.28.1 as released")
def test_what_keras_3_cannot_do_is_one_clear_error():
    result = succeeded(subprocess.run([PYTHON, "-c", REFUSED, json.dumps([code for code, _ in CANNOT])], cwd=ROOT,
                                      capture_output=True, text=True, timeout=120))
    for error, (code, expected) in zip(json.loads(output_lines(result.stdout)[-1]), CANNOT):
        assert error and error.startswith("ValueError") and expected in error and "\n" not in error, (code, error)


def test_the_wrapped_optimizer_shares_the_same_variables_before_and_after_a_step():
    """What the broadcast callback and an elastic job's sync send, in this process: a worker that joins
    an elastic job before its first step must send the same variables as the ranks that trained (the
    model's variables, tracked into the optimizer's after its first step, hung such a job)."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    from hvd_sgd.training import distributed
    hvd.init()
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))
    optimizer.build(model.trainable_variables)
    names = lambda: [getattr(v, "path", v.name) for v in distributed.shared_variables(optimizer)]
    before = names()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones((2, 4))))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    assert names() == before and len(before) >= 3, (before, names())
