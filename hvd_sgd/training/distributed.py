"""Horovod's wrapper, on either stack: every rank applies the average of all ranks' gradients.

It is ``hvd.DistributedOptimizer`` under both Keras 2 (TensorFlow 2.15) and Keras 3 (TensorFlow
2.16 and later). Under Keras 3, Horovod 0.28.1's wrapper trained without averaging (horovod#4290):
the installation's Horovod is patched there (run/patches/horovod-0.28.1-keras-3.patch; docs/design.md,
"Horovod on Keras 3"), so a user's own Horovod script averages too.
"""
import importlib.metadata
import os

from hvd_sgd import JobError

# tf.keras is Keras 3 from TensorFlow 2.16 on, unless TF_USE_LEGACY_KERAS=1 selects tf_keras (Keras 2).
KERAS_3 = int(importlib.metadata.version(
    "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras").split(".")[0]) >= 3


def DistributedOptimizer(optimizer, compression, backward_passes_per_step=1):  # noqa: N802 (named as Horovod's)
    """``hvd.DistributedOptimizer(optimizer)``: ``minimize`` (below) accumulates the gradient over
    ``backward_passes_per_step`` calls, all-reduces their mean once (compressed as ``compression``
    says) and applies the average of all ranks'."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    if not KERAS_3 and isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer):
        # Horovod cannot wrap Keras 2's loss-scale optimizer (its constructor takes no inner one): it
        # wraps the inner one, whose compute_gradients it averages, before the scale checks them.
        if backward_passes_per_step > 1:
            raise JobError("--precision mixed_float16 with --backward-passes-per-step needs the current stack: "
                           "Keras 2's loss scale would judge each rank's micro-batches apart (docs/guide.md, "
                           "\"Two stacks\"); or use mixed_bfloat16")
        return tf.keras.mixed_precision.LossScaleOptimizer(
            DistributedOptimizer(optimizer.inner_optimizer, compression))
    try:
        return hvd.DistributedOptimizer(optimizer, compression=compression,
                                        backward_passes_per_step=backward_passes_per_step,
                                        average_aggregated_gradients=True)
    except ValueError as error:  # Horovod's one line: wrapped twice, not a Keras optimizer of this stack
        raise JobError(str(error)) from None


def minimize(optimizer, loss, variables, tape):
    """One backward pass of ``loss`` on ``tape`` into ``optimizer``: Keras 2's ``minimize``; Keras 3
    has none, so the loss is scaled on the tape (a loss scale's, or 1) and the gradients applied."""
    if not KERAS_3:
        return optimizer.minimize(loss, variables, tape=tape)
    with tape:
        scaled = optimizer.scale_loss(loss)
    return optimizer.apply(tape.gradient(scaled, variables), variables)


def shared_variables(optimizer):
    """The optimizer's variables that every rank holds alike, which are broadcast and compared: all but
    Keras 3's gradient accumulators, each rank's own micro-batches of an update under way (the patched
    Horovod's rule; Keras 2's optimizers hold none)."""
    try:
        from horovod.tensorflow.util import optimizer_variables_to_broadcast
    except ImportError:  # the Keras 2 stack's Horovod, as released
        return list(optimizer.variables)
    return optimizer_variables_to_broadcast(optimizer)
