"""Checkpoints: rank 0 writes them, rank 0 reads them, the training loop broadcasts them.

A checkpoint is a ``tf.train.Checkpoint`` of the model, the optimizer (momentum included) and
the global step, managed by ``tf.train.CheckpointManager``: TensorFlow writes the data under a
temporary name and renames it, then replaces the small ``checkpoint`` index file atomically, so
a crash mid-write leaves the previous checkpoint as the latest. Every tensor carries a CRC32C
that is verified on reading, so a damaged file is detected and the one before it is used.
"""
import os

import tensorflow as tf

from hvd_sgd import JobError

KEEP = 3


class Checkpoints:
    def __init__(self, directory, world, resume, **trackables):
        """``directory`` None: nothing is written or read. Only the chief touches the files."""
        self.directory = directory
        self.world = world
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.manager = None
        if directory and world.is_chief:
            try:
                os.makedirs(directory, exist_ok=True)
                probe = os.path.join(directory, f".write-test-{os.getpid()}")
                open(probe, "w").close()
                os.remove(probe)
            except OSError as e:
                raise JobError(f"--checkpoint-dir {directory} is not writable: {e.strerror}") from None
            self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=KEEP,
                                                      checkpoint_name="ckpt")
            if self.manager.checkpoints and not resume:
                raise JobError(f"--checkpoint-dir {directory} already holds checkpoints: "
                               f"add --resume to continue from them, or choose another directory")

    def save(self, step):
        if self.manager and self.manager.latest_checkpoint != self._path(step):
            self.manager.save(checkpoint_number=step)

    def restore_latest(self):
        """On the chief, load the newest readable checkpoint into the trackables; True if one was found.

        The caller broadcasts the variables afterwards, so the other ranks receive it.
        """
        if not self.manager:
            return False
        for path in reversed(self._inside_directory(self.manager.checkpoints)):
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
                self.world.log(f"Resuming from {path}")
                return True
            except (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError, IndexError) as e:
                self.world.log(f"Skipping damaged checkpoint {path}: {str(e).strip().splitlines()[0]}")
            except (ValueError, AssertionError, tf.errors.InvalidArgumentError) as e:
                raise JobError(f"{path} does not fit this model: {str(e).splitlines()[0]}") from None
        raise JobError(f"--resume: no readable checkpoint in {self.directory}")

    def _path(self, step):
        return os.path.join(self.directory, f"ckpt-{step}")

    def _inside_directory(self, paths):
        """Never follow the index file to a checkpoint outside the given directory."""
        root = os.path.realpath(self.directory)
        inside = [p for p in paths if os.path.dirname(os.path.realpath(p)) == root]
        for p in sorted(set(paths) - set(inside)):
            self.world.log(f"Ignoring checkpoint {p}: it is outside {self.directory}")
        return inside
