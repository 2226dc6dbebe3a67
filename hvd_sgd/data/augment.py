"""``--augment``: the standard random crop with padding and horizontal flip, drawn per example.

An example's crop and flip are a function of (seed, epoch, example) alone, drawn on the host one
epoch at a time, so a batch is augmented the same whichever rank builds it, and N ranks still
train exactly like one.
"""
import numpy as np
import tensorflow as tf


def padding(image_size):
    """The padding of the random crop: an eighth of the image's side (4 pixels of a 32x32 image)."""
    return max(1, round(min(image_size) / 8))


def draws(plan, image_size, seed, first_step, indices):
    """(flip, dy, dx) for each example of ``indices`` (a rank's rows, one a global step from
    ``first_step``), each an array of the shape of ``indices``."""
    pad = padding(image_size)
    flip, dy, dx = (np.empty(indices.shape, np.int64) for _ in range(3))
    epochs = (first_step + np.arange(len(indices))) // plan.steps_per_epoch
    for epoch in np.unique(epochs):
        rng = np.random.default_rng([seed, int(epoch), 1])  # [seed, epoch] draws the order
        drawn = rng.integers(0, [2, 2 * pad + 1, 2 * pad + 1], size=(plan.num_examples, 3))
        rows = epochs == epoch
        flip[rows], dy[rows], dx[rows] = (drawn[indices[rows], k] for k in range(3))
    return flip, dy, dx


def padded_crop_and_flip(image, flip, dy, dx):
    """``image`` [h, w, c] padded with zeros on each side, cropped back to its size at (dy, dx), and
    mirrored left to right if ``flip``."""
    height, width, channels = image.shape
    pad = padding((height, width))
    image = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])[dy:dy + height, dx:dx + width]
    image = tf.cond(flip > 0, lambda: tf.reverse(image, [1]), lambda: image)
    return tf.ensure_shape(image, (height, width, channels))
