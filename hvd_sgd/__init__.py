"""hvd_sgd: data-parallel synchronous SGD for TensorFlow on MPI through Horovod."""
import os
import re

# TensorFlow's C++ start-up chatter (oneDNN, CPU features) is printed once per rank;
# keep warnings and errors only, unless the user asked for more.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow uses oneDNN's CPU kernels by default only on CPUs with AVX-512 VNNI/BF16, AVX-VNNI or AMX;
# on AVX2-only CPUs its default kernels train convolutions much slower (docs/design.md). On
# everywhere, unless the user set it. Like the line above, it counts only before TensorFlow's import.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

__version__ = "0.1.0"


def __getattr__(name):
    """The API for your own model and data, imported on first use (TensorFlow is slow to import):
    ``hvd_sgd.fit``, ``hvd_sgd.TrainConfig``, ``hvd_sgd.Splits``, ``hvd_sgd.datasets``,
    ``hvd_sgd.SyncBatchNormalization`` (Horovod's, on either stack: under Keras 3 the installation's
    patch of it; a saved model holds a plain BatchNormalization in its place, training.models.export)."""
    import importlib
    api = dict(fit=("hvd_sgd.train", "fit"), TrainConfig=("hvd_sgd.config", "TrainConfig"),
               Splits=("hvd_sgd.data.datasets", "Splits"), datasets=("hvd_sgd.data.datasets", None),
               SyncBatchNormalization=("horovod.tensorflow", "SyncBatchNormalization"))
    if name not in api:
        raise AttributeError(f"module 'hvd_sgd' has no attribute {name!r}")
    module_name, attribute = api[name]
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


class JobError(Exception):
    """Ends the job with one line from one rank, never N tracebacks: bad input, divergence, ..."""


def first_line(error, limit=200):
    """An exception's message as one line of a one-line error: its first line that says something
    (not Keras' "Exception encountered when calling …", which says only where, nor its terminal
    colours), cut to ``limit`` characters (None: whole); the exception's type when it has none."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()]
    lines = [line for line in lines if line and not line.startswith("Exception encountered when calling")]
    line = lines[0] if lines else type(error).__name__
    return line if limit is None or len(line) <= limit else line[:limit - 1] + "…"
