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
    if not KERAS_3:
        return hvd.DistributedOptimizer(optimizer, compression=compression,
                                        backward_passes_per_step=backward_passes_per_step,
                                        average_aggregated_gradients=True)
    if isinstance(optimizer, _AveragedKeras3) or hasattr(optimizer, "_allreduce_grads"):
        raise JobError(f"{type(optimizer).__name__} is already wrapped (hvd.DistributedOptimizer does not "
                       f"average under Keras 3): pass the plain Keras optimizer")
    config = optimizer.get_config()
    if any(config.get(clip) for clip in ("clipnorm", "clipvalue", "global_clipnorm")):
        raise JobError("gradient clipping would clip each rank's gradient before the average: not supported")
    if backward_passes_per_step > 1:  # Keras 3 accumulates and applies the mean every that many calls
        config["gradient_accumulation_steps"] = backward_passes_per_step
    # A subclass under the optimizer's name and module, as Horovod makes: a saved (or cloned)
    # compiled model names Keras' own SGD, which loads without hvd_sgd.
    base = type(optimizer)
    cls = type(base.__name__, (_AveragedKeras3, base), dict(__module__=base.__module__))
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
        # One rank has nothing to average, and an all-reduce would wait for Horovod's next cycle
        # (1 ms there): Horovod's own wrapper skips it too.
        import horovod.tensorflow as hvd
        if hvd.size() > 1:
            grads = hvd.grouped_allreduce(list(grads), op=hvd.Average, compression=self.compression)
        super()._backend_update_step(grads, trainable_variables, learning_rate)
