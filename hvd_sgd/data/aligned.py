"""Arrays in memory aligned like this, which TensorFlow takes over without a copy (batches.as_tensor);
its own conversion holds two more copies of a training set at once. No TensorFlow here: the data
command reads arrays without it."""
import math

import numpy as np

ALIGNMENT = 64


def empty(shape, dtype):
    """An uninitialised C-contiguous array whose data starts on an ALIGNMENT-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)
