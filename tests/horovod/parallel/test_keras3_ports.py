# Copyright 2019 Uber Technologies, Inc. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Ports, for the current stack (Keras 3, NumPy 2), of the Horovod 0.28.1 tests beside this file
whose own code calls what Keras 3 removed or NumPy 2 changed. Each is the test as Horovod wrote
it with those calls changed (marked "port:") and nothing it asserts; its docstring's first line
gives the reason. tests/test_horovod_suite.py runs them in place of the originals there."""

import itertools

import numpy as np
import tensorflow as tf
from parameterized import parameterized
from tensorflow import keras

import horovod.keras as hvd_standalone_keras
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
from horovod.runner.common.util.env import get_env_rank_and_size


# Horovod started once, with the two static process sets of test_tensorflow_process_sets.py.
_, SIZE = get_env_rank_and_size()
EVEN_RANKS = [rk for rk in range(0, SIZE) if rk % 2 == 0]
ODD_RANKS = [rk for rk in range(0, SIZE) if rk % 2 == 1]
EVEN_SET, ODD_SET = hvd.ProcessSet(EVEN_RANKS), hvd.ProcessSet(ODD_RANKS)
hvd.init(process_sets=[EVEN_SET, ODD_SET])


class TestingOptimizer(keras.optimizers.Optimizer):
    """The gradient-aggregation tests' optimizer (each test defines its own; one here), as Keras 3
    subclasses take it: with a learning rate, and update_step(gradient, variable, learning_rate)."""

    def __init__(self, name, learning_rate=0.1, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_add(gradient)


class Keras3PortsTests(tf.test.TestCase):

    def tearDown(self):
        """Prevent that one process shuts down Horovod too early (as test_tensorflow_process_sets.py)."""
        with tf.device("/cpu:0"):
            hvd.allreduce(tf.constant([0.]), name="global_barrier_after_test")

    # --- test_tensorflow.py ---------------------------------------------------------------------

    def test_horovod_syncbn_cpu(self):
        """port: Keras 3's BatchNormalization takes no fused argument (the test passes fused=False)."""
        with tf.device("/cpu:0"):
            x_list = [
                tf.convert_to_tensor(np.stack([
                    np.array([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1], [r * 4, r * 4 + 1]],
                             dtype=np.float32)
                    for r in range(hvd.size())]), np.float32),
                tf.convert_to_tensor(np.stack([
                    np.array([[r + 1], [r * 2 + 1], [r * 3 + 1], [r * 4 + 1]], dtype=np.float32)
                    for r in range(hvd.size())]), np.float32),
            ]
            for x in x_list:
                bn = tf.keras.layers.BatchNormalization(axis=1)  # port: no fused=False
                sync_bn = hvd.SyncBatchNormalization(axis=1)
                bn_out = bn(x, training=True)
                sync_bn_out = sync_bn(tf.expand_dims(x[hvd.rank()], 0), training=True)
                self.assertAllClose(sync_bn_out, np.expand_dims(bn_out[hvd.rank()], 0))
                self.assertAllClose(sync_bn.moving_mean, bn.moving_mean)
                self.assertAllClose(sync_bn.moving_variance, bn.moving_variance)

    def test_partial_distributed_gradient_tape(self):
        """port: a Keras 3 variable has no .ref() (the test keys its dictionaries by it): id() instead."""
        if hvd.size() == 1:
            self.skipTest("Only one worker available")
        for num_local_layers in range(3):
            model = tf.keras.models.Sequential()
            initializer = tf.keras.initializers.Constant(hvd.rank())
            model.add(tf.keras.layers.Dense(2, input_shape=(3,), kernel_initializer=initializer,
                                            bias_initializer=initializer))
            model.add(tf.keras.layers.RepeatVector(3))
            model.add(tf.keras.layers.TimeDistributed(tf.keras.layers.Dense(3, kernel_initializer=initializer,
                                                                            bias_initializer=initializer)))
            model.compile(loss=tf.keras.losses.MSE, metrics=[tf.keras.metrics.categorical_accuracy])
            X = np.random.random((1, 3))
            Y = np.random.random((1, 3, 3))
            with tf.GradientTape(persistent=True) as tape:
                p = model(X, training=True)
                l = model.loss(Y, p)
            gradients = tape.gradient(l, model.trainable_weights)
            local_layers = model.layers[:num_local_layers]
            var_grad = {id(var): grad for var, grad in zip(model.trainable_weights, gradients)}  # port: id
            local_vars = [id(var) for layer in local_layers for var in layer.trainable_weights]
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=local_layers)
            allreduced_gradients = tape.gradient(l, model.trainable_weights)
            local_vars_grads, global_vars_grads = tape.get_local_and_global_gradients(l, model.trainable_weights)
            for var, grad in zip(model.trainable_weights, allreduced_gradients):
                if id(var) in local_vars:
                    self.assertAllClose(grad, var_grad[id(var)] / hvd.size())
                else:
                    self.assertNotAllClose(grad, var_grad[id(var)])
            for var, grad in local_vars_grads:
                self.assertAllClose(grad, var_grad[id(var)] / hvd.size())
            for var, grad in global_vars_grads:
                self.assertNotAllClose(grad, var_grad[id(var)])

    # --- test_tensorflow_process_sets.py --------------------------------------------------------

    def test_horovod_reducescatter_grad_cpu_process_sets(self):
        """port: NumPy 2 compares a float16 error with 1e-8 in float16, where 1e-8 is 0 (NEP 50): in float."""
        rank = hvd.rank()
        for red_op, dtype, dim in itertools.product([hvd.Sum, hvd.Average], [tf.float16, tf.float32, tf.float64],
                                                    [1, 2, 3]):
            with tf.device("/cpu:0"):
                ranks, process_set = (EVEN_RANKS, EVEN_SET) if rank in EVEN_RANKS else (ODD_RANKS, ODD_SET)
                tf.random.set_seed(1234)
                tensor = tf.Variable(tf.random.uniform([len(ranks) * 4] * dim, -100, 100, dtype=dtype))
                with tf.GradientTape() as tape:
                    reduced = hvd.reducescatter(tensor, op=red_op, process_set=process_set)
                set_size = len(ranks)
                grad_ys = tf.ones([4] + [set_size * 4] * (dim - 1), dtype=tensor.dtype)
                grad_out = tape.gradient(tf.cast(reduced, dtype=tensor.dtype), tensor, grad_ys)
            expected = np.ones([set_size * 4] * dim) * (set_size if red_op == hvd.Sum else 1)
            err = np.linalg.norm(expected - grad_out)
            self.assertLess(float(err), 0.00000001,  # port: float(err)
                            "gradient %s differs from expected %s, error: %s" % (grad_out, expected, str(err)))

    # --- test_tensorflow2_keras.py --------------------------------------------------------------

    def test_train_model_lr_schedule(self):
        """port: Keras 3 has no losses.mean_squared_error, ThresholdedReLU, compile(experimental_run_tf_function)
        or optimizer.lr."""
        initial_lr = 0.1 * hvd.size()
        opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam())

        def linear_multiplier(epoch):
            return epoch

        model = keras.models.Sequential()
        model.add(keras.layers.Dense(2, input_shape=(3,)))
        model.add(keras.layers.RepeatVector(3))
        model.add(keras.layers.ReLU(threshold=0.5))  # port: ThresholdedReLU(0.5)
        model.compile(loss=keras.losses.MeanSquaredError(), optimizer=opt,
                      metrics=[keras.metrics.categorical_accuracy])
        x = np.random.random((10, 3))
        y = np.random.random((10, 3, 2))

        class StoreLearningRateCallback(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                lr = self.model.optimizer.learning_rate.numpy()  # port: learning_rate
                if 0 <= epoch < 5:
                    assert lr <= initial_lr or np.isclose(lr, initial_lr)
                if 5 < epoch < 10:
                    assert lr <= initial_lr * 1e-1 or np.isclose(lr, initial_lr * 1e-1)
                if 10 < epoch < 15:
                    assert lr < initial_lr * 1e-2 or np.isclose(lr, initial_lr * 1e-2)
                if 15 <= epoch < 20:
                    assert np.isclose(lr, initial_lr * linear_multiplier(epoch))

        callbacks = [
            hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd_keras.callbacks.MetricAverageCallback(),
            hvd_keras.callbacks.LearningRateWarmupCallback(initial_lr=initial_lr, warmup_epochs=5),
            hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-1,
                                                             start_epoch=5, end_epoch=10),
            hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-2,
                                                             start_epoch=10, end_epoch=15),
            hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=linear_multiplier,
                                                             start_epoch=15, end_epoch=20),
            StoreLearningRateCallback()]
        train_history = model.fit(x, y, steps_per_epoch=5, callbacks=callbacks, epochs=20)
        loss_metrics_tensor = tf.convert_to_tensor(train_history.history["loss"], dtype=tf.float32)
        self.assertAllClose(hvd.broadcast(loss_metrics_tensor, root_rank=0), loss_metrics_tensor)

    def test_sparse_as_dense(self):
        """port: Keras 3's optimizers take no lr=, its Embedding no input_length, its losses no mean_squared_error."""
        opt = hvd_keras.DistributedOptimizer(keras.optimizers.RMSprop(learning_rate=0.0001), sparse_as_dense=True)
        model = keras.models.Sequential()
        model.add(keras.layers.Embedding(1000, 64))
        model.compile(loss=keras.losses.MeanSquaredError(), optimizer=opt)
        x = np.random.randint(1000, size=(32, 10))
        y = np.random.random((32, 10, 64))
        model.train_on_batch(x, y)

    def test_legacy_optimizer(self):
        """port: Keras 3 keeps keras.optimizers.legacy as names that raise ImportError; the test skips
        when the legacy optimizers are not available, and checks for the name only."""
        try:
            opt = keras.optimizers.legacy.Adam(learning_rate=0.0001)
        except ImportError:
            self.skipTest("Keras legacy optimizers not available")
        opt = hvd_keras.DistributedOptimizer(opt)
        model = keras.models.Sequential()
        model.add(keras.layers.Dense(2, input_shape=(3,)))
        model.compile(loss=keras.losses.MeanSquaredError(), optimizer=opt)
        model.train_on_batch(np.random.random((10, 3)), np.random.random((10, 2)))

    def test_sparse_as_dense_with_grad_aggregation(self):
        """port: lr=, input_length and mean_squared_error as above; Keras 3 accumulates the backward passes
        itself (gradient_accumulation_steps): the pending passes are in its accumulators and _iterations."""
        backward_passes_per_step = 2
        opt = hvd_keras.DistributedOptimizer(keras.optimizers.RMSprop(learning_rate=0.0001), sparse_as_dense=True,
                                             backward_passes_per_step=backward_passes_per_step)
        model = keras.models.Sequential()
        model.add(keras.layers.Embedding(1000, 64))
        model.compile(loss=keras.losses.MeanSquaredError(), optimizer=opt)
        x = np.random.randint(1000, size=(32, 10))
        y = np.random.random((32, 10, 64))
        training_steps = 3
        for _ in range(training_steps):
            model.train_on_batch(x, y)
        aggregation_counter = int(opt._iterations.numpy()) % backward_passes_per_step  # port: the counter
        assert aggregation_counter == training_steps % backward_passes_per_step
        pending = any(np.any(a.numpy() != 0) for a in opt._accumulated_gradients)
        assert pending == bool(training_steps % backward_passes_per_step)

    def test_grad_aggregation_with_inf_grad(self):
        """port: Keras 3 optimizers have no _compute_gradients (a tape gives the gradients); the aggregated
        gradient of the second cycle is Keras 3's accumulator."""
        backward_passes_per_step = 2
        step_count = tf.Variable(0, trainable=False, dtype=tf.int32)
        opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(),
                                             backward_passes_per_step=backward_passes_per_step, sparse_as_dense=True)
        x = tf.Variable(0.)
        var = [x]

        def loss():
            step_count.assign_add(1)
            return tf.cond(pred=tf.greater(step_count, 1), true_fn=lambda: x, false_fn=lambda: x * float('inf'))

        for step in range(2 * backward_passes_per_step):
            with tf.GradientTape() as tape:  # port: the tape, not opt._compute_gradients
                value = loss()
            grads = tape.gradient(value, var)
            opt.apply_gradients(zip(grads, var))
            if step >= backward_passes_per_step:
                # in the first aggregation cycle the gradient is infinite, and it should be cleaned
                # up to zero after apply_gradients and doesn't affect the 2nd aggregation cycle
                assert tf.math.is_finite(opt._accumulated_gradients[0])

    @parameterized.expand([[True], [False]])
    def test_gradient_aggregation(self, average_aggregated_gradients):
        """port: a Keras 3 optimizer subclass takes a learning rate and update_step(gradient, variable,
        learning_rate); a tape gives the gradients; Keras 3 counts the passes in _iterations and holds
        the pending ones in its accumulators."""
        backward_passes_per_step = 4
        hvd_optimizer = hvd_keras.DistributedOptimizer(
            optimizer=TestingOptimizer("test"), backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, sparse_as_dense=True)
        x_0 = 0.0
        y_0, y_1 = 1.0, 2.0
        x = tf.Variable([x_0])
        y = tf.Variable([y_0, y_1])
        variables = [x, y]

        def loss():
            return x - tf.gather(y, [0])

        def compute_expected_value(batch_id):
            num_of_steps = (batch_id + 1) // backward_passes_per_step
            gradient_of_x = num_of_steps * 1.0
            gradient_of_y_0 = num_of_steps * -1.0
            if not average_aggregated_gradients:
                gradient_of_x *= backward_passes_per_step
                gradient_of_y_0 *= backward_passes_per_step
            return np.array(x_0 + gradient_of_x), np.array([y_0 + gradient_of_y_0, y_1])

        @tf.function
        def compute_and_apply_gradients_in_tf_function(var_list):
            with tf.GradientTape() as tape:
                value = loss()
            hvd_optimizer.apply_gradients(zip(tape.gradient(value, var_list), var_list))

        total_num_of_steps = 10
        for idx in range(total_num_of_steps):
            compute_and_apply_gradients_in_tf_function(variables)
            expected_x, expected_y = compute_expected_value(idx)
            assert np.isclose(variables[0].numpy(), expected_x)
            assert np.isclose(variables[1].numpy(), expected_y).all()
            assert idx + 1 == hvd_optimizer._iterations.numpy()  # port: _iterations
        aggregation_counter = total_num_of_steps % backward_passes_per_step
        assert np.isclose(hvd_optimizer._accumulated_gradients[0].numpy(), aggregation_counter * 1.0)

    @parameterized.expand([[True], [False]])
    def test_gradient_aggregation_with_local_vars(self, average_aggregated_gradients):
        """port: as test_gradient_aggregation."""
        backward_passes_per_step = 4
        hvd_optimizer = hvd_keras.DistributedOptimizer(
            optimizer=TestingOptimizer("test"), backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, sparse_as_dense=True)
        total_num_variables = 8
        num_local_vars = 4
        X_0 = [0.0] * total_num_variables
        Y_0, Y_1 = [1.0] * total_num_variables, [2.0] * total_num_variables
        X = [tf.Variable([x_0]) for x_0 in X_0]
        Y = [tf.Variable([y_0, y_1]) for y_0, y_1 in zip(Y_0, Y_1)]
        variables = [X, Y]
        flatten_variables = [item for sublist in variables for item in sublist]
        for i in range(num_local_vars):
            hvd_optimizer.register_local_var(X[i])
            hvd_optimizer.register_local_var(Y[i])

        def loss():
            return X - (float(hvd.rank() + 1) * tf.gather(Y, [0], axis=1))

        def compute_expected_value(batch_id):
            num_of_steps = (batch_id + 1) // backward_passes_per_step
            gradient_of_x = num_of_steps * 1.0
            gradient_of_y_multiplier = float(hvd.size() + 1) / 2
            gradient_of_y_0 = num_of_steps * gradient_of_y_multiplier * -1.0
            if not average_aggregated_gradients:
                gradient_of_x *= backward_passes_per_step
                gradient_of_y_0 *= backward_passes_per_step
            expected_x = np.array(X_0)
            for i in range(len(X_0)):
                expected_x[i] += gradient_of_x / hvd.size() if i < num_local_vars else gradient_of_x
            expected_y_0 = np.array(Y_0)
            for i in range(len(Y_0)):
                if i < num_local_vars:
                    expected_y_0[i] += ((gradient_of_y_0 / gradient_of_y_multiplier) * float(hvd.rank() + 1)) / hvd.size()
                else:
                    expected_y_0[i] += gradient_of_y_0
            expected_y = [[ey0, ey1] for ey0, ey1 in zip(expected_y_0, np.array(Y_1))]
            return np.reshape(expected_x, (-1, 1)), np.array(expected_y)

        @tf.function
        def compute_and_apply_gradients_in_tf_function(var_list):
            with tf.GradientTape() as tape:
                value = loss()
            hvd_optimizer.apply_gradients(zip(tape.gradient(value, var_list), var_list))

        total_num_of_steps = 10
        for idx in range(total_num_of_steps):
            compute_and_apply_gradients_in_tf_function(flatten_variables)
            expected_x, expected_y = compute_expected_value(idx)
            assert np.isclose(np.array(variables[0]), expected_x).all()
            assert np.isclose(np.array(variables[1]), expected_y).all()
            assert idx + 1 == hvd_optimizer._iterations.numpy()  # port: _iterations
        aggregation_counter = total_num_of_steps % backward_passes_per_step
        assert np.isclose(hvd_optimizer._accumulated_gradients[0].numpy(), aggregation_counter * 1.0)

    def test_partial_distributed_optimizer(self):
        """port: Keras 3 optimizers have no _compute_gradients: the averaged gradients are those the
        wrapper all-reduces (_hvd_allreduce); a Keras 3 variable has no .ref() (id instead)."""
        if hvd.size() == 1:
            self.skipTest("Only one worker available")
        for num_local_layers in range(3):
            model = tf.keras.models.Sequential()
            initializer = tf.keras.initializers.Constant(hvd.rank())
            model.add(tf.keras.layers.Dense(2, input_shape=(3,), kernel_initializer=initializer,
                                            bias_initializer=initializer))
            model.add(tf.keras.layers.RepeatVector(3))
            model.add(tf.keras.layers.TimeDistributed(tf.keras.layers.Dense(3, kernel_initializer=initializer,
                                                                            bias_initializer=initializer)))
            opt = tf.keras.optimizers.Adam()
            model.compile(loss=tf.keras.losses.MSE, metrics=[tf.keras.metrics.categorical_accuracy])
            X = np.random.random((1, 3))
            Y = np.random.random((1, 3, 3))
            with tf.GradientTape(persistent=True) as tape:
                p = model(X, training=True)
                l = model.loss(Y, p)
            gradients_tape = tape.gradient(l, model.trainable_weights)
            local_layers = model.layers[:num_local_layers]
            opt = hvd_standalone_keras.PartialDistributedOptimizer(opt, sparse_as_dense=True, local_layers=local_layers)
            gradients_opt = opt._hvd_allreduce(list(gradients_tape), model.trainable_weights)  # port
            var_grad_tape = {id(var): grad for var, grad in zip(model.trainable_weights, gradients_tape)}
            var_grad_opt = {id(var): grad for var, grad in zip(model.trainable_weights, gradients_opt)}
            local_vars = [id(var) for layer in local_layers for var in layer.trainable_weights]
            for var in model.trainable_weights:
                if id(var) in local_vars:
                    self.assertAllClose(var_grad_tape[id(var)], hvd.size() * var_grad_opt[id(var)])
                else:
                    self.assertNotAllClose(var_grad_tape[id(var)], var_grad_opt[id(var)])

    def test_broadcast_global_variables_callback_with_local_vars(self):
        """port: a Keras 3 variable has no .ref() (the test keys by it): id() instead."""
        if hvd.size() == 1:
            self.skipTest("Only one worker available")
        root_rank = hvd.size() - 1
        X = np.random.random((1, 3))
        Y = np.random.random((1, 3, 3))
        model = tf.keras.models.Sequential()
        initializer = tf.keras.initializers.Constant(hvd.rank())
        model.add(tf.keras.layers.Dense(3, input_shape=(3,), kernel_initializer=initializer,
                                        bias_initializer=initializer, trainable=False))
        for _ in range(3):
            model.add(tf.keras.layers.Dense(3, kernel_initializer=initializer, bias_initializer=initializer,
                                            trainable=False))
        model.add(tf.keras.layers.RepeatVector(3))
        model.add(tf.keras.layers.Dense(3, kernel_initializer=initializer, bias_initializer=initializer,
                                        trainable=False))
        model.compile(loss=tf.keras.losses.MSE, metrics=[tf.keras.metrics.categorical_accuracy])
        local_variables = [var for var in model.layers[0].variables]
        callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(root_rank=root_rank,
                                                                          local_variables=local_variables)]
        model.fit(X, Y, callbacks=callbacks)
        local_variables_ref = [id(var) for var in local_variables]  # port: id
        for var in model.variables:
            if id(var) in local_variables_ref:
                self.assertAllClose(var, tf.constant(float(hvd.rank()), shape=var.shape))
            else:
                self.assertAllClose(var, tf.constant(float(root_rank), shape=var.shape))
