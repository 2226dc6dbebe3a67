"""The learning-rate schedule: linear warm-up to the scaled rate, then optional cosine decay.

Goyal et al. (2017): with N ranks the global batch is N times larger, so the rate is N times
larger too (the linear scaling rule), reached gradually over the first epochs. The schedule is a
function of the global step alone, so a resumed run follows it exactly.
"""
import math

import tensorflow as tf


@tf.keras.utils.register_keras_serializable("hvd_sgd")
class WarmupCosine(tf.keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, base, scale_by_world_size, warmup_steps, decay_steps):
        """From ``base`` to ``base`` x ranks (or ``base`` itself) over ``warmup_steps``, then cosine
        down to 0 at ``decay_steps`` (no decay when ``decay_steps`` is 0). The number of ranks is
        read when the rate is, so it follows an elastic job that grows or shrinks."""
        self.base, self.scale_by_world_size = float(base), bool(scale_by_world_size)
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)

    def __call__(self, step):
        # Imported here, not at the top: importing this module must not load Horovod's extension
        # before world.start() has checked it can report a broken build in one line.
        from horovod.tensorflow.mpi_ops import size_op
        step = tf.cast(step, tf.float32)
        peak = self.base * (tf.cast(size_op(), tf.float32) if self.scale_by_world_size else 1.0)
        warmup = tf.maximum(float(self.warmup_steps), 1.0)
        rate = self.base + (peak - self.base) * tf.minimum(step / warmup, 1.0)
        if self.decay_steps > self.warmup_steps:
            progress = tf.clip_by_value((step - self.warmup_steps) / (self.decay_steps - self.warmup_steps), 0.0, 1.0)
            rate = tf.where(step < self.warmup_steps, rate, peak * 0.5 * (1.0 + tf.cos(math.pi * progress)))
        return rate

    def get_config(self):
        return dict(base=self.base, scale_by_world_size=self.scale_by_world_size,
                    warmup_steps=self.warmup_steps, decay_steps=self.decay_steps)
