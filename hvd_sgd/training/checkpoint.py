"""Checkpoints of the chief: one run per directory, written atomically, read back with a fallback.

A checkpoint is a ``tf.train.Checkpoint`` of the model, the optimizer (momentum included) and
the global step, managed by ``tf.train.CheckpointManager``: TensorFlow writes the data under a
temporary name and renames it, then replaces the small ``checkpoint`` index file atomically, so
a crash mid-write leaves the previous checkpoint as the latest. Every tensor carries a CRC32C
that is verified on reading, so a damaged file is detected and the one before it is used.
"""
import fcntl
import glob
import os
import socket
import time

import tensorflow as tf

from hvd_sgd import JobError, first_line
from hvd_sgd.runtime import watchdog
from hvd_sgd.training import files

KEEP = 3
LOCK_FILE = ".hvd_sgd.lock"


def lock_directory(directory, what):
    """Take an exclusive ``flock`` on a file in ``directory`` for the rest of this process's life.

    The descriptor is never closed: the kernel drops the lock when the process ends, however it
    ends, so a killed run leaves no stale lock. On NFS, Linux turns ``flock`` into a POSIX lock that
    the server arbitrates, so it holds between nodes too (docs/design.md, "Checkpoints"). ``what`` names the flag in the one-line error.
    """
    files.check_writable(directory, what)
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)  # not truncated: holder stays
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 1024, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise JobError(f"{what} is in use by another run ({holder}): wait for it to end, "
                       f"or choose another directory") from None
    except OSError as e:  # a file system without locks (Lustre mounted noflock, say)
        os.close(fd)
        raise JobError(f"{what} cannot be locked ({e.strerror}): its file system has no working flock "
                       f"(docs/design.md, \"Checkpoints\")") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, "
                  f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode(), 0)


class Checkpoints:
    """The chief's checkpoints in ``directory``, locked against other runs for this process's life."""

    def __init__(self, directory, resume, log, global_batch, **trackables):
        """``global_batch``: examples per step, recorded with every checkpoint, since the data order
        and the epoch's steps follow from it: a run that resumes must have the same."""
        self.directory, self.log = directory, log
        lock_directory(directory, f"--checkpoint-dir {directory}")
        self.global_batch = tf.Variable(global_batch, dtype=tf.int64, trainable=False, name="global_batch")
        self.checkpoint = tf.train.Checkpoint(global_batch=self.global_batch, **trackables)
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=KEEP, checkpoint_name="ckpt")
        if self.manager.checkpoints and not resume:
            raise JobError(f"--checkpoint-dir {directory} already holds checkpoints: "
                           f"add --resume to continue from them, or choose another directory")

    def save(self, step):
        if self.manager.latest_checkpoint != self._path(step):
            self.manager.save(checkpoint_number=step)

    def restore_latest(self):
        """Load the newest readable checkpoint into the trackables; the caller broadcasts them."""
        expected = int(self.global_batch.numpy())
        for path in reversed(self._inside_directory(self.manager.checkpoints)):
            try:
                _read_through(path)
                self.checkpoint.restore(path).assert_existing_objects_matched()
                saved = int(self.global_batch.numpy())
                if saved != expected:
                    raise JobError(f"{path} was trained with a global batch of {saved} examples a step, this run "
                                   f"has {expected} (ranks x --batch-size x --backward-passes-per-step): resume with "
                                   f"the same global batch, e.g. another --batch-size for another number of ranks")
                self.log(f"Resuming from {path}")
                return
            except (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError, IndexError,
                    OSError) as e:
                self.log(f"Skipping damaged checkpoint {path}: {first_line(e)}")
            except (ValueError, AssertionError, tf.errors.InvalidArgumentError) as e:
                raise JobError(f"{path} does not fit this model: {first_line(e)}") from None
        raise JobError(f"--resume: no readable checkpoint in {self.directory}")

    def _path(self, step):
        return os.path.join(self.directory, f"ckpt-{step}")

    def _inside_directory(self, paths):
        """Never follow the index file to a checkpoint outside the given directory."""
        root = os.path.realpath(self.directory)
        inside = [p for p in paths if os.path.dirname(os.path.realpath(p)) == root]
        for p in sorted(set(paths) - set(inside)):
            self.log(f"Ignoring checkpoint {p}: it is outside {self.directory}")
        return inside


def _read_through(prefix):
    """Read the files of checkpoint ``prefix`` once, front to back: TensorFlow's own reads (pread)
    move no file position, so the stall watchdog would see no progress on a slow file system;
    they then find the files in the page cache."""
    chunk = bytearray(watchdog.READ_CHUNK)
    for name in sorted(glob.glob(glob.escape(prefix) + ".*")):
        with open(name, "rb", buffering=0) as f:
            while f.readinto(chunk):
                pass
