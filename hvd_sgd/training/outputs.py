"""What rank 0 writes, in one place: TensorBoard, checkpoints, the exported model, the metrics file.

Every rank holds the run's Outputs and calls it alike; only rank 0's writes (``world.is_chief``):
it holds what every rank holds, and one copy of each file is wanted. ``check`` finds out before
training, not after it, whether rank 0 can write what was asked for.
"""
import tensorflow as tf

from hvd_sgd.runtime import startup
from hvd_sgd.training import checkpoint, files, models


class Outputs:
    def __init__(self, outputs, checkpointing, world, watchdog):
        """``outputs``, ``checkpointing``: the configuration's sections (hvd_sgd.config)."""
        self.cfg, self.checkpointing, self.world, self.watchdog = outputs, checkpointing, world, watchdog
        self.writes = world.is_chief
        self.summaries = self.checkpoints = None

    def check(self):
        """Rank 0 can write every file asked for (else a JobError); TensorBoard's writer opens."""
        if not self.writes:
            return
        for flag, path in (("--save-model", self.cfg.save_model), ("--metrics-file", self.cfg.metrics_file)):
            if path:
                files.check_writable(files.parent(path), f"{flag} {path}")
        if self.cfg.log_dir:
            files.check_writable(self.cfg.log_dir, f"--log-dir {self.cfg.log_dir}")
            self.summaries = tf.summary.create_file_writer(self.cfg.log_dir)

    def check_exportable(self, model):
        """--save-model can write ``model`` (on every rank: it is each rank's model that would fail)."""
        if self.cfg.save_model:
            models.check_exportable(model, self.cfg.save_model)

    def open_checkpoints(self, plan, state):
        """Rank 0's checkpoints in --checkpoint-dir, locked against other runs, with the latest
        restored into ``state`` on --resume (the caller broadcasts it). A job that Slurm requeued
        (after a stop, a node failure, preemption) resumes as --resume would."""
        directory, resume = self.checkpointing.checkpoint_dir, self.checkpointing.resume
        if not (self.writes and directory):
            return
        requeued = startup.slurm_requeued()
        with self.watchdog.file_work(directory):  # the others wait: a slow file system is no stall
            self.checkpoints = checkpoint.Checkpoints(directory, resume or requeued, self.world.log, plan.global_batch,
                                                      model=state.model, optimizer=state.optimizer, step=state.step)
            if resume or (requeued and self.checkpoints.manager.checkpoints):
                if not resume:
                    self.world.log(f"Slurm requeued {requeued}: resuming, as --resume would")
                self.checkpoints.restore_latest()

    def save_checkpoint(self, step):
        if self.checkpoints:
            with self.watchdog.file_work(self.checkpointing.checkpoint_dir):
                self.checkpoints.save(step)

    def scalars(self, step, values):
        """TensorBoard scalars {name: value} at ``step``."""
        if self.summaries:
            with self.summaries.as_default(step=step):
                for name, value in values.items():
                    tf.summary.scalar(name, value)

    def finish(self, model, summary):
        """The exported model (--save-model) and the run's summary (--metrics-file)."""
        if not self.writes:
            return
        if self.cfg.save_model:
            models.export(model, self.cfg.save_model)
            self.world.log(f"Model saved to {self.cfg.save_model}")
        if self.cfg.metrics_file:
            files.write_json(self.cfg.metrics_file, summary)
