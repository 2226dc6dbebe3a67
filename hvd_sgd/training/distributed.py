"""The wrapper that makes every rank apply the average of all ranks' gradients, on either stack.

Under Keras 2 (TensorFlow 2.15) it is ``hvd.DistributedOptimizer``. Under Keras 3 (TensorFlow
2.16 and later) Horovod 0.28.1's wrapper trains without error and does not average: each rank
applies its own gradient (horovod/horovod#4290). There, ``DistributedOptimizer`` below does what
Horovod's does, with ``horovod.tensorflow``'s all-reduce, which works under any Keras
(docs/design.md, "Two stacks").
"""
import importlib.metadata
import os

from hvd_sgd import JobError

# tf.keras is Keras 3 from TensorFlow 2.16 on, unless TF_USE_LEGACY_KERAS=1 selects tf_keras (Keras 2).
KERAS_3 = int(importlib.metadata.version(
    "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras").split(".")[0]) >= 3


def DistributedOptimizer(optimizer, compression, backward_passes_per_step=1):  # noqa: N802 (named as Horovod's)
    """``optimizer``, changed so that ``minimize(loss, var_list, tape)`` accumulates the gradient
    over ``backward_passes_per_step`` calls, all-reduces the mean once (compressed as
    ``compression`` says) and applies the average of all ranks'."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    loss_scaled = isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
    if loss_scaled and backward_passes_per_step > 1:
        raise JobError("--precision mixed_float16 with --backward-passes-per-step: the loss scale would judge each "
                       "rank's micro-batches apart; use mixed_bfloat16, or one backward pass a step")
    if not KERAS_3:
        if loss_scaled:
            # Horovod cannot wrap Keras 2's loss-scale optimizer (its constructor takes no inner one): it
            # wraps the inner one, whose compute_gradients it averages, before the scale checks them.
            return tf.keras.mixed_precision.LossScaleOptimizer(
                DistributedOptimizer(optimizer.inner_optimizer, compression, backward_passes_per_step))
        return hvd.DistributedOptimizer(optimizer, compression=compression,
                                        backward_passes_per_step=backward_passes_per_step,
                                        average_aggregated_gradients=True)
    if isinstance(optimizer, (_AveragedKeras3, _AveragedLossScale)) or hasattr(optimizer, "_allreduce_grads"):
        raise JobError(f"{type(optimizer).__name__} is already wrapped (hvd.DistributedOptimizer does not "
                       f"average under Keras 3): pass the plain Keras optimizer")
    if loss_scaled:
        return _wrapped(optimizer, _AveragedLossScale, optimizer.get_config(), compression)
    config = optimizer.get_config()
    if any(config.get(clip) for clip in ("clipnorm", "clipvalue", "global_clipnorm")):
        raise JobError("gradient clipping would clip each rank's gradient before the average: not supported")
    if backward_passes_per_step > 1:  # Keras 3 accumulates and applies the mean every that many calls
        config["gradient_accumulation_steps"] = backward_passes_per_step
    return _wrapped(optimizer, _AveragedKeras3, config, compression)


def _wrapped(optimizer, averaging, config, compression):
    """``optimizer`` remade, from ``config``, as a subclass of its class with ``averaging`` before it:
    under its name and module, as Horovod makes it, so that a saved (or cloned) compiled model names
    Keras' own class, which loads without hvd_sgd."""
    base = type(optimizer)
    cls = type(base.__name__, (averaging, base), dict(__module__=base.__module__))
    wrapped = cls.from_config(config)
    wrapped.compression = compression
    return wrapped


def tf_variables(variables):
    """The tf.Variables behind Keras variables, which Horovod's broadcast can assign to (a Keras 3
    variable wraps one; a Keras 2 variable is one)."""
    import tensorflow as tf
    return [v if isinstance(v, tf.Variable) else v.value for v in variables]


class _AveragedKeras3:
    """Placed before a Keras 3 optimizer's class: ``minimize`` as Horovod's wrapper has it, and
    the all-reduce where Keras updates the variables."""

    def minimize(self, loss, var_list, tape):
        self.apply(tape.gradient(loss, var_list), var_list)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Keras calls this once per update, after its gradient accumulation and before the
        # variables change: the one all-reduce of a step, as hvd.DistributedOptimizer makes.
        super()._backend_update_step(_averaged(grads, self.compression), trainable_variables, learning_rate)


class _AveragedLossScale:
    """Placed before Keras 3's LossScaleOptimizer: the loss scaled under the tape, and the ranks' scaled
    gradients averaged before the scale's check of them, so that a gradient that overflowed on one
    rank makes every rank skip the step and halve the scale (its inner optimizer does not average)."""

    def minimize(self, loss, var_list, tape):
        with tape:
            scaled = self.scale_loss(loss)
        self.apply(tape.gradient(scaled, var_list), var_list)

    def apply(self, grads, trainable_variables=None):
        super().apply(_averaged(grads, self.compression), trainable_variables)


def _averaged(grads, compression):
    """The average of every rank's ``grads``, one grouped all-reduce. One rank has nothing to average,
    and an all-reduce would wait for Horovod's next cycle (1 ms there): Horovod's own wrapper skips it too."""
    import horovod.tensorflow as hvd
    if hvd.size() == 1:
        return grads
    return hvd.grouped_allreduce(list(grads), op=hvd.Average, compression=compression)


def SyncBatchNormalization(**kwargs):  # noqa: N802 (a layer's name)
    """Batch normalization whose training statistics are the global batch's: every step the ranks
    all-reduce each channel's sum, sum of squares and count. Under Keras 2 it is Horovod's
    ``hvd.SyncBatchNormalization``; under Keras 3, where Horovod's cannot be built, hvd_sgd's. A saved
    model holds a plain BatchNormalization in its place (models.export)."""
    if not KERAS_3:
        import horovod.tensorflow as hvd
        return hvd.SyncBatchNormalization(**kwargs)
    return _keras_3_sync_batch_normalization()(**kwargs)


def _keras_3_sync_batch_normalization():
    """The class, made on first use (it subclasses Keras 3's layer, and uses Horovod's extension)."""
    global _SyncBatchNormalizationKeras3
    if _SyncBatchNormalizationKeras3 is None:
        import horovod.tensorflow as hvd
        import keras
        from keras import ops

        @keras.saving.register_keras_serializable("hvd_sgd")
        class SyncBatchNormalization(keras.layers.BatchNormalization):
            def _moments(self, inputs, mask):
                if mask is not None or hvd.size() == 1:
                    return super()._moments(inputs, mask)
                count = ops.cast(ops.size(inputs) // ops.shape(inputs)[self.axis], inputs.dtype)
                sums = ops.concatenate([ops.reshape(count, [1]), ops.sum(inputs, self._reduction_axes),
                                        ops.sum(ops.square(inputs), self._reduction_axes)], axis=0)
                total = hvd.allreduce(sums, op=hvd.Sum, name=f"{self.name}_moments")
                channels = (ops.shape(total)[0] - 1) // 2
                mean = total[1:1 + channels] / total[0]
                return mean, ops.maximum(total[1 + channels:] / total[0] - ops.square(mean), 0.0)

        _SyncBatchNormalizationKeras3 = SyncBatchNormalization
    return _SyncBatchNormalizationKeras3


_SyncBatchNormalizationKeras3 = None
