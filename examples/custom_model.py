"""Your own model and data, trained by hvd_sgd's recipe on every rank of the job:

    horovodrun -np 2 python examples/custom_model.py
"""
import tensorflow as tf

import hvd_sgd


def small_cnn(input_shape, num_classes):
    """Any function of (input shape, number of classes) returning an uncompiled Keras model of logits."""
    return tf.keras.Sequential([
        tf.keras.Input(input_shape),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(num_classes),
    ], name="small_cnn")


class SmallCNN(tf.keras.Model):
    """The same model written as a subclass: it trains the same way; --save-model refuses it before
    training (plain TensorFlow cannot load a subclass without its code), --checkpoint-dir keeps it."""

    def __init__(self, num_classes):
        super().__init__(name="small_cnn_subclassed")
        self.conv = tf.keras.layers.Conv2D(16, 3, activation="relu")
        self.pool = tf.keras.layers.MaxPooling2D()
        self.flatten = tf.keras.layers.Flatten()
        self.logits = tf.keras.layers.Dense(num_classes)

    def call(self, images):
        return self.logits(self.flatten(self.pool(self.conv(images))))


def small_cnn_subclassed(input_shape, num_classes):
    return SmallCNN(num_classes)


def my_data():
    """Your arrays: uint8 images [n, height, width] (or [n, height, width, channels]) and integer
    labels [n]. Here, part of MNIST."""
    mnist = hvd_sgd.datasets.load("mnist")
    return hvd_sgd.Splits("my-digits", x_train=mnist.x_train[:8000], y_train=mnist.y_train[:8000],
                          x_test=mnist.x_test[:2000], y_test=mnist.y_test[:2000])


if __name__ == "__main__":
    # Every flag of python -m hvd_sgd.train is a field here; the same defaults apply.
    config = hvd_sgd.TrainConfig(epochs=2, batch_size=32, lr=0.02, log_every_steps=40)
    summary = hvd_sgd.fit(small_cnn, my_data(), config)
