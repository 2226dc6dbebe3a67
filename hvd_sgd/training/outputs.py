"""What rank 0 writes, in one place: TensorBoard, checkpoints, Horovod's timeline, the exported model,
the metrics file and its series (an object a --log-every-steps interval, every rank's figures).

Every rank holds the run's Outputs and calls it alike; only rank 0's writes (``world.is_chief``):
it holds what every rank holds, and one copy of each file is wanted. ``check`` finds out before
training, not after it, whether rank 0 can write what was asked for.
"""
import json
import os

import tensorflow as tf

from hvd_sgd import JobError
from hvd_sgd.runtime import announced
from hvd_sgd.training import checkpoint, files, models


class Outputs:
    def __init__(self, outputs, checkpointing, world, watchdog):
        """``outputs``, ``checkpointing``: the configuration's sections (hvd_sgd.config)."""
        self.cfg, self.checkpointing, self.world, self.watchdog = outputs, checkpointing, world, watchdog
        self.summaries = self.checkpoints = self.series = None
        # --timeline-steps, parsed once: the loop asks before and after every step.
        self.timeline_window = outputs.timeline_window() if outputs.timeline else None
        self.timeline_on = False

    @property
    def writes(self):
        """Whether this rank writes: rank 0, asked each time (an elastic job renumbers its ranks)."""
        return self.world.is_chief

    def follow_chief(self):
        """At an elastic (re)start: a rank that has become rank 0 (the first one left the job) goes on
        with the series and TensorBoard's log, and writes the model and the summary at the end. The
        checkpoints stay with the first rank 0 (their directory is locked to its process)."""
        if self.writes:
            self._open_logs(series_mode="a")

    def _open_logs(self, series_mode):
        """TensorBoard's writer and the metrics series, unless this rank has them open."""
        if self.cfg.log_dir and self.summaries is None:
            self.summaries = tf.summary.create_file_writer(self.cfg.log_dir)
        if self.cfg.metrics_file and self.series is None:
            self.series = open(series_path(self.cfg.metrics_file), series_mode)

    def check(self, plan):
        """Rank 0 can write every file asked for (else a JobError); TensorBoard's writer opens. The
        timeline's window is in the run (``plan``)."""
        if self.timeline_window and self.timeline_window[0] > plan.total_steps:
            raise JobError(f"--timeline-steps {self.cfg.timeline_steps}: the run has {plan.total_steps} steps")
        if not self.writes:
            return
        for flag, path in (("--save-model", self.cfg.save_model), ("--metrics-file", self.cfg.metrics_file),
                           ("--timeline", self.cfg.timeline)):
            if path:
                files.check_writable(files.parent(path), f"{flag} {path}")
        if self.cfg.log_dir:
            files.check_writable(self.cfg.log_dir, f"--log-dir {self.cfg.log_dir}")
        # A resumed run goes on with its series; another run starts its own.
        self._open_logs(series_mode="a" if self.checkpointing.resume else "w")

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
        requeued = announced.slurm_requeued()
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
        if self.summaries and self.writes:
            with self.summaries.as_default(step=step):
                for name, value in values.items():
                    tf.summary.scalar(name, value)

    def interval(self, record):
        """One line of the metrics series: JSON Lines (pandas.read_json(path, lines=True))."""
        if self.series and self.writes:
            self.series.write(json.dumps(record) + "\n")
            self.series.flush()

    def timeline_before(self, step):
        """Before global step ``step``: Horovod's timeline starts in --timeline-steps' window (every
        rank starts and stops it; rank 0 writes it)."""
        if self.timeline_window and not self.timeline_on:
            first, last = self.timeline_window
            if first <= step <= last:
                import horovod.tensorflow as hvd
                hvd.start_timeline(os.path.abspath(self.cfg.timeline))
                self.timeline_on = True

    def timeline_after(self, step):
        """After global step ``step``: the timeline stops at the window's end."""
        if self.timeline_on and step >= self.timeline_window[1]:
            self.stop_timeline()

    def stop_timeline(self):
        """Stop the timeline, if it records, and leave its file valid JSON: Horovod 0.28.1 leaves its list
        of events open (a stop on a signal, an error, the end of the run come here too)."""
        if not self.timeline_on:
            return
        import horovod.tensorflow as hvd
        hvd.stop_timeline()  # returns once Horovod has closed the file
        self.timeline_on = False
        if self.writes:
            _close_event_list(self.cfg.timeline)

    def finish(self, model, summary):
        """The exported model (--save-model) and the run's summary (--metrics-file)."""
        if not self.writes:
            return
        if self.cfg.save_model:
            models.export(model, self.cfg.save_model)
            self.world.log(f"Model saved to {self.cfg.save_model}")
        if self.cfg.metrics_file:
            if self.series:
                self.series.close()
            files.write_json(self.cfg.metrics_file, summary)


def series_path(metrics_file):
    """The metrics series beside the summary: metrics.json -> metrics.jsonl."""
    return metrics_file + "l" if metrics_file.endswith(".json") else metrics_file + ".jsonl"


def _close_event_list(path):
    """The JSON list of trace events in ``path`` closed, unless it is already: "[]" if no event came."""
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text = (text or "[") + "]"
    json.loads(text)  # a file still broken is Horovod's bug: a traceback, not a silent bad file
    files.write_text(path, text + "\n")
