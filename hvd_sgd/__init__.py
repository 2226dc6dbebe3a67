"""hvd_sgd: data-parallel synchronous SGD for TensorFlow on MPI through Horovod."""
import os

# TensorFlow's C++ start-up chatter (oneDNN, CPU features) is printed once per rank;
# keep warnings and errors only, unless the user asked for more.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"


class JobError(Exception):
    """Ends the job with one line from one rank, never N tracebacks: bad input, divergence, ..."""
