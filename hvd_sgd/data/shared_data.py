"""The training set once per node, in shared memory.

Each rank gathers its batches from the whole training set, so each rank held a copy: a node
needed the set's size times its ranks. Instead, the first rank of each node (local rank 0) reads
the arrays into files under /dev/shm (memory, not disk) and the node's other ranks map the same
pages (docs/design.md, "One copy of the training set a node"). The files are unlinked once every rank has mapped them, so
the memory goes with the job's last process; a killed job's files are removed by the next job
on that node. Where /dev/shm is missing or too small, every rank reads its own copy.
"""
import glob
import math
import os
import socket

import numpy as np

from hvd_sgd import JobError
from hvd_sgd.data import aligned, datasets

SHARED_MEMORY = "/dev/shm"
PREFIX = "hvd_sgd-data-"


def load(read):
    """``read(allocate)`` (datasets.load with its allocator) once per node: the same Splits on
    every rank, backed by the node's one copy. Every rank calls it and meets the others twice,
    whatever fails where (a JobError on one rank is raised on all)."""
    import horovod.tensorflow as hvd
    files = _SharedFiles() if hvd.local_rank() == 0 else None
    splits = layout = error = None
    try:
        if files:
            try:
                splits = read(files.allocate)
                layout = files.layout(splits)
            except JobError as e:
                error = str(e)
        host = socket.gethostname()
        everyone = hvd.allgather_object((host, hvd.local_rank(), layout, error))
        error = next((e for _, _, _, e in everyone if e), None)
        if error is None and splits is None:
            node = next((layout for h, local_rank, layout, _ in everyone if h == host and local_rank == 0), None)
            try:
                splits = _map_or_read(node, read)
            except JobError as e:
                error = str(e)
        # Every rank has mapped the files (their names can go) and knows the others' errors.
        error = next((e for e in hvd.allgather_object(error) if e), None)
    finally:
        if files:
            files.unlink()
    if error:
        raise JobError(error)
    return splits


def remove_stale():
    """Files whose process is gone (a killed job never unlinked them); others' files stay."""
    for path in glob.glob(os.path.join(SHARED_MEMORY, f"{PREFIX}*")):
        pid = os.path.basename(path)[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(path)
            except OSError:
                pass


class _SharedFiles:
    """The node's copy: a file under /dev/shm for each array, mapped by the ranks that use it."""

    def __init__(self):
        remove_stale()
        self.shared, self.full = [], False  # (array, its file), and whether /dev/shm ran out of room

    def allocate(self, shape, dtype):
        """A datasets allocator: an array in a new shared file (page-aligned: TensorFlow takes it
        over), or in private memory once /dev/shm lacks room, or for no bytes (nothing to map)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        # Writing into a full /dev/shm would kill the process (SIGBUS), not raise: check first.
        self.full = self.full or not os.path.isdir(SHARED_MEMORY) or _free_bytes(SHARED_MEMORY) < 2 * nbytes
        if self.full or nbytes == 0:
            return aligned.empty(shape, dtype)
        path = os.path.join(SHARED_MEMORY, f"{PREFIX}{os.getpid()}-{len(self.shared)}")
        # A new file, the user's alone (the data may be private), never one planted in its place.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "r+b") as f:
            f.truncate(nbytes)
            array = np.memmap(f, dtype, "r+", shape=shape)  # the mapping outlives the file object
        self.shared.append((array, path))
        return array

    def layout(self, splits):
        """What the node's other ranks need to map ``splits`` (each array's file, shape and type);
        None if an array is not in a file: they read their own copy. An array made after reading
        (labels converted to bytes) is copied into a file of its own."""
        arrays = {}
        for key in datasets.IDX_FILES:
            array = getattr(splits, key)
            if self._file_of(array) is None:
                array = self.allocate(array.shape, array.dtype)
                array[...] = getattr(splits, key)
            path = self._file_of(array)
            if path is None:
                return None
            arrays[key] = (path, array.shape, array.dtype.str)
        return dict(name=splits.name, num_classes=splits.num_classes, arrays=arrays)

    def _file_of(self, array):
        return next((path for shared, path in self.shared if shared is array), None)

    def unlink(self):
        for _, path in self.shared:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _map_or_read(layout, read):
    if layout:
        try:
            arrays = {key: np.memmap(path, dtype, "r+", shape=tuple(shape))
                      for key, (path, shape, dtype) in layout["arrays"].items()}
            return datasets.Splits(layout["name"], **arrays, num_classes=layout["num_classes"])
        except (OSError, ValueError):  # not this node's files after all (two nodes of one host name)
            pass
    return read(aligned.empty)


def _free_bytes(path):
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True
