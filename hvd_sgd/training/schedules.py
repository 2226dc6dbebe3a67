"""The learning-rate schedule: linear warm-up to the scaled rate, then optional cosine decay.

Goyal et al. (2017): a global batch N times larger takes an N times larger rate (the linear
scaling rule), reached gradually over the first epochs. The schedule is a function of the global
step alone, so a resumed run follows it exactly. Its numbers come from the run plan.
"""
import math

import tensorflow as tf


@tf.keras.utils.register_keras_serializable("hvd_sgd")
class WarmupCosine(tf.keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, base, peak, warmup_steps, decay_steps, backward_passes_per_step=1):
        """From ``base`` to ``peak`` over ``warmup_steps``, then cosine down to 0 at ``decay_steps``
        (no decay when it is 0)."""
        self.base, self.peak = float(base), float(peak)
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.backward_passes_per_step = int(backward_passes_per_step)

    @classmethod
    def following(cls, plan):
        """The schedule of a run plan (hvd_sgd.plan.RunPlan)."""
        return cls(plan.base_lr, plan.peak_lr, plan.warmup_steps, plan.decay_steps, plan.backward_passes)

    def __call__(self, iterations):
        # Keras passes the optimizer's iterations, which gradient accumulation advances once per
        # backward pass: divided by the passes per step, they are the global step.
        return self.at_step(tf.math.floordiv(iterations, self.backward_passes_per_step))

    def at_step(self, step):
        step = tf.cast(step, tf.float32)
        # Without a warm-up the peak rate applies from the first step.
        warmed_up = tf.minimum(step / self.warmup_steps, 1.0) if self.warmup_steps else 1.0
        rate = self.base + (self.peak - self.base) * warmed_up
        if self.decay_steps > self.warmup_steps:
            progress = tf.clip_by_value((step - self.warmup_steps) / (self.decay_steps - self.warmup_steps), 0.0, 1.0)
            rate = tf.where(step < self.warmup_steps, rate, self.peak * 0.5 * (1.0 + tf.cos(math.pi * progress)))
        return rate

    def get_config(self):
        return dict(base=self.base, peak=self.peak, warmup_steps=self.warmup_steps, decay_steps=self.decay_steps,
                    backward_passes_per_step=self.backward_passes_per_step)
