"""The models, users' own models, and the export of a trained one.

A model function takes the input shape (height, width, 1), pixels in [0, 1], and the number of
classes, and returns an uncompiled Keras model whose outputs are logits.
"""
import importlib

import tensorflow as tf

from hvd_sgd import JobError


def softmax(input_shape, num_classes):
    """The classic TF1 MNIST model: y = softmax(x W + b), W and b starting at zero."""
    return tf.keras.Sequential([
        tf.keras.Input(input_shape),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(num_classes, kernel_initializer="zeros", name="logits"),
    ], name="softmax")


def mlp(input_shape, num_classes):
    return tf.keras.Sequential([
        tf.keras.Input(input_shape),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(num_classes, name="logits"),
    ], name="mlp")


def cnn(input_shape, num_classes):
    """Two convolutions, max-pooling, dropout and a dense layer: about 99.2 % on MNIST."""
    return tf.keras.Sequential([
        tf.keras.Input(input_shape),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(num_classes, name="logits"),
    ], name="cnn")


BUILT_IN = {"softmax": softmax, "mlp": mlp, "cnn": cnn}


def resolve(spec):
    """A built-in model's name, or ``package.module:function``: the model function it names."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = "" if getattr(e, "name", None) == module_name else f" ({e})"
        raise JobError(f"--model {spec}: cannot import module {module_name!r}{missing}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise JobError(f"--model {spec}: module {module_name!r} has no function {attribute!r}")
    return function


def build(model_fn, input_shape, num_classes, seed):
    """The same initial weights on every rank for a given seed (rank 0's are broadcast anyway)."""
    tf.keras.utils.set_random_seed(seed)
    model = model_fn(tuple(input_shape), num_classes)
    if not isinstance(model, tf.keras.Model):
        name = getattr(model_fn, "__qualname__", model_fn)
        raise JobError(f"--model: {name} returned {type(model).__name__}, not a Keras model")
    return model


def export(model, path):
    """Keras format, compiled with the loss and accuracy but not Horovod's optimizer, so that
    plain TensorFlow loads and evaluates it without Horovod or hvd_sgd."""
    exported = tf.keras.models.clone_model(model)
    exported.set_weights(model.get_weights())
    exported.compile(optimizer=tf.keras.optimizers.SGD(), loss=model.loss, metrics=["accuracy"])
    exported.optimizer.build(exported.trainable_variables)  # saved as built: loads without warnings
    exported.save(path)
