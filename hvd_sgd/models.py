"""The models: all take images [h, w, 1] in [0, 1] and return logits over 10 classes."""
import tensorflow as tf

from hvd_sgd.data import NUM_CLASSES


def softmax(image_shape):
    """The classic TF1 MNIST model: y = softmax(x W + b), W and b starting at zero."""
    return tf.keras.Sequential([
        tf.keras.Input((*image_shape, 1)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(NUM_CLASSES, kernel_initializer="zeros", name="logits"),
    ], name="softmax")


def mlp(image_shape):
    return tf.keras.Sequential([
        tf.keras.Input((*image_shape, 1)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(NUM_CLASSES, name="logits"),
    ], name="mlp")


def cnn(image_shape):
    """Two convolutions, max-pooling, dropout and a dense layer: about 99.2 % on MNIST."""
    return tf.keras.Sequential([
        tf.keras.Input((*image_shape, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(NUM_CLASSES, name="logits"),
    ], name="cnn")


BUILDERS = {"softmax": softmax, "mlp": mlp, "cnn": cnn}


def build(name, image_shape, seed):
    """The same initial weights on every rank for a given seed (rank 0's are broadcast anyway)."""
    tf.keras.utils.set_random_seed(seed)
    return BUILDERS[name](image_shape)
