"""The learning-rate schedule: linear warm-up to the scaled rate, then optional cosine decay.

Goyal et al. (2017): a global batch N times larger takes an N times larger rate (the linear
scaling rule), reached gradually over the first epochs. The schedule is a function of the global
step alone, so a resumed run follows it exactly.
"""
import math

import tensorflow as tf


@tf.keras.utils.register_keras_serializable("hvd_sgd")
class WarmupCosine(tf.keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, base, factor, scale_by_world_size, warmup_steps, decay_steps, backward_passes_per_step=1):
        """From ``base`` to ``base`` x ``factor`` (x ranks, if ``scale_by_world_size``) over
        ``warmup_steps``, then cosine down to 0 at ``decay_steps`` (no decay when it is 0). The
        number of ranks is read when the rate is, so it follows an elastic job that grows or shrinks."""
        self.base, self.factor, self.scale_by_world_size = float(base), float(factor), bool(scale_by_world_size)
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.backward_passes_per_step = int(backward_passes_per_step)

    def __call__(self, iterations):
        # Keras passes the optimizer's iterations, which Horovod's gradient accumulation advances
        # once per backward pass: divided by the passes per step, they are the global step.
        return self.at_step(tf.math.floordiv(iterations, self.backward_passes_per_step))

    def at_step(self, step):
        step = tf.cast(step, tf.float32)
        peak = self.base * self.factor
        if self.scale_by_world_size:
            # Imported here, not at the top: importing this module must not load Horovod's extension
            # (before startup.start() has checked it can report a broken build in one line, or at all
            # in plain Keras).
            from horovod.tensorflow.mpi_ops import size_op
            peak *= tf.cast(size_op(), tf.float32)
        # Without a warm-up the scaled rate applies from the first step.
        warmed_up = tf.minimum(step / self.warmup_steps, 1.0) if self.warmup_steps else 1.0
        rate = self.base + (peak - self.base) * warmed_up
        if self.decay_steps > self.warmup_steps:
            progress = tf.clip_by_value((step - self.warmup_steps) / (self.decay_steps - self.warmup_steps), 0.0, 1.0)
            rate = tf.where(step < self.warmup_steps, rate, peak * 0.5 * (1.0 + tf.cos(math.pi * progress)))
        return rate

    def get_config(self):
        return dict(base=self.base, factor=self.factor, scale_by_world_size=self.scale_by_world_size,
                    warmup_steps=self.warmup_steps, decay_steps=self.decay_steps,
                    backward_passes_per_step=self.backward_passes_per_step)
