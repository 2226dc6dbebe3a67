"""The models, users' own models, the loss they train with, and the export of a trained one.

A model function takes the input shape (height, width, channels; 1 for grayscale), pixels in
[0, 1], and the number of classes, and returns an uncompiled Keras model whose outputs are logits.
"""
import importlib
import traceback

import tensorflow as tf

from hvd_sgd import JobError, first_line


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
    """Pixels moved to [-1, 1], three 3x3 convolutions (16, 32, 64 channels), the first two each
    followed by max-pooling, and a dense layer of 64 on the 7x7 maps: a sixth of classic_cnn's
    arithmetic. Keeping 7x7 positions for the dense layer and centring the pixels on zero make it
    as accurate after the default 2 epochs (docs/design.md, "The recipe")."""
    return tf.keras.Sequential([
        tf.keras.Input(input_shape),
        tf.keras.layers.Rescaling(2.0, offset=-1.0),
        tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(num_classes, name="logits"),
    ], name="cnn")


def classic_cnn(input_shape, num_classes):
    """The Keras MNIST example's CNN (1.2 M weights), hvd_sgd's default before ``cnn``: two
    convolutions, max-pooling, dropout and a dense layer; about 99.2 % after 4 epochs."""
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
    ], name="classic_cnn")


def resnet20(input_shape, num_classes):
    """The CIFAR ResNet of He et al. (2016, section 4.2), 20 layers: a 3x3 convolution of 16, then three
    stages of 3 basic blocks (16, 32, 64 channels; the first block of the second and third halves the
    size, with a 1x1 projection as its shortcut), global average pooling and the logits."""
    def conv(x, filters, stride=1, kernel=3):
        return tf.keras.layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False,
                                      kernel_initializer="he_normal")(x)

    def block(x, filters, stride):
        y = tf.keras.layers.ReLU()(tf.keras.layers.BatchNormalization()(conv(x, filters, stride)))
        y = tf.keras.layers.BatchNormalization()(conv(y, filters))
        shortcut = x if stride == 1 else tf.keras.layers.BatchNormalization()(conv(x, filters, stride, kernel=1))
        return tf.keras.layers.ReLU()(tf.keras.layers.Add()([y, shortcut]))

    inputs = tf.keras.Input(input_shape)
    x = tf.keras.layers.ReLU()(tf.keras.layers.BatchNormalization()(conv(inputs, 16)))
    for stage, filters in enumerate((16, 32, 64)):
        for i in range(3):
            x = block(x, filters, 2 if stage and i == 0 else 1)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes, name="logits")(x), name="resnet20")


def resnet50(input_shape, num_classes):
    """Keras Applications' ResNet-50, channels last, from scratch (no weights), with logits: images of
    at least 32x32 pixels."""
    return tf.keras.applications.ResNet50(weights=None, input_shape=tuple(input_shape), classes=num_classes,
                                          classifier_activation=None)


BUILT_IN = {"softmax": softmax, "mlp": mlp, "cnn": cnn, "classic_cnn": classic_cnn, "resnet20": resnet20,
            "resnet50": resnet50}


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


def smoothed_cross_entropy(label_smoothing):
    """The training loss: cross-entropy of the logits against one-hot labels moved
    ``label_smoothing`` toward uniform, so that the model is not pushed to ever larger logits
    (Szegedy et al. 2016); it lets a short run take a high learning rate."""
    loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=label_smoothing)
    # Labels come as [B] from hvd_sgd's step and as [B, 1] from Keras' fit: one-hot of them flat.
    return lambda labels, logits: loss(tf.one_hot(tf.reshape(tf.cast(labels, tf.int32), [-1]), tf.shape(logits)[-1]),
                                       logits)


def build(model_fn, input_shape, num_classes, seed):
    """The same initial weights on every rank for a given seed (rank 0's are broadcast anyway).

    A model function that fails, or whose model does not map a batch of ``input_shape`` images to
    ``num_classes`` logits each, is a JobError naming it: one line, before training starts (a
    model of too few outputs would otherwise train on labels it cannot represent)."""
    name = getattr(model_fn, "__qualname__", model_fn)
    tf.keras.utils.set_random_seed(seed)
    try:
        model = model_fn(tuple(input_shape), num_classes)
    except Exception as e:
        raise JobError(f"--model: {name} raised {_described(e, model_fn)}") from None
    if not isinstance(model, tf.keras.Model):
        raise JobError(f"--model: {name} returned {type(model).__name__}, not a Keras model")
    declared = getattr(model, "inputs", None)  # a Sequential or functional model's; a subclass has none yet
    if declared and not (len(declared) == 1 and _fits(tuple(declared[0].shape)[1:], tuple(input_shape))):
        shapes = ", ".join(str(tuple(x.shape)[1:]) for x in declared)
        raise JobError(f"--model: {name}'s model takes inputs of shape {shapes}, not images of shape "
                       f"{tuple(input_shape)}")
    try:
        outputs = model(tf.zeros((1, *input_shape)), training=False)
    except Exception as e:
        raise JobError(f"--model: {name}'s model cannot take images of shape {tuple(input_shape)}: "
                       f"{_described(e, model_fn)}") from None
    if tuple(outputs.shape) != (1, num_classes):
        raise JobError(f"--model: {name}'s model gives an output of shape {tuple(outputs.shape)[1:]} for an image, "
                       f"not {num_classes} logits")
    return model


def _exportable(layer):
    config = layer.get_config()
    if "dtype" in config:
        config["dtype"] = "float32"
    plain = tf.keras.layers.BatchNormalization if isinstance(layer, tf.keras.layers.BatchNormalization) else type(layer)
    return plain.from_config(config)


def _fits(declared, shape):
    return len(declared) == len(shape) and all(d is None or d == n for d, n in zip(declared, shape))


def _described(error, model_fn):
    """``Type: its first line``, and the innermost line of the model function's file that the
    error passed through (the user's code, not Keras')."""
    source = getattr(getattr(model_fn, "__code__", None), "co_filename", None)
    own = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == source]
    name, line = type(error).__name__, first_line(error)
    return (name if line == name else f"{name}: {line}") + (f" ({source}, line {own[-1].lineno})" if own else "")


def check_exportable(model, path):
    """``export`` writes a file that Keras rebuilds from the model's config alone, which it can for
    a Sequential or functional model but not for a subclassed one (it needs the class's code):
    refused before training, not after it."""
    if not any(cls.__name__ in ("Sequential", "Functional") for cls in type(model).__mro__):
        raise JobError(f"--save-model {path}: {type(model).__name__} is a subclassed Keras model, which plain "
                       f"TensorFlow cannot load without its code: build it as a Sequential or functional model, "
                       f"or keep its weights with --checkpoint-dir")


def export(model, path):
    """Keras format, compiled with the loss and accuracy but not Horovod's optimizer, so that
    plain TensorFlow loads and evaluates it without Horovod or hvd_sgd: every layer in float32,
    whatever precision trained it (the weights are float32 in each), and a plain BatchNormalization
    in place of a synchronized one (the same variables; the statistics are the global batch's
    only in training)."""
    exported = tf.keras.models.clone_model(model, clone_function=_exportable)
    exported.set_weights(model.get_weights())
    exported.compile(optimizer=tf.keras.optimizers.SGD(), loss=model.loss, metrics=["accuracy"])
    exported.optimizer.build(exported.trainable_variables)  # saved as built: loads without warnings
    exported.save(path)
