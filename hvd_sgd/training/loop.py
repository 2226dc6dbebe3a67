"""The training loop, its clock, and the elastic path that restarts it on another set of ranks."""
import contextlib
import dataclasses
import time

import tensorflow as tf

from hvd_sgd.data import batches
from hvd_sgd.runtime import cli
from hvd_sgd.training import distributed, models, precision, schedules
from hvd_sgd.training.plan import RunPlan
from hvd_sgd.training.progress import Progress, StepClock, finite, sampled


@dataclasses.dataclass
class State:
    """What training changes, which every rank holds alike: broadcast at the start, checkpointed,
    compared bit for bit at the end."""
    model: tf.keras.Model
    optimizer: tf.keras.optimizers.Optimizer
    step: tf.Variable  # the global step: weight updates so far
    schedule: schedules.WarmupCosine  # the optimizer's learning rate

    @classmethod
    def starting(cls, model, optimizer, schedule):
        """The state before the first step."""
        return cls(model, optimizer, tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step"), schedule)

    def variables(self):
        return (self.model.variables + distributed.shared_variables(self.optimizer)
                + precision.loss_scale_variables(self.optimizer) + [self.step])

    def follow(self, plan):
        """The optimizer's learning rate becomes ``plan``'s schedule (before the step is traced)."""
        self.schedule = self.optimizer.learning_rate = schedules.WarmupCosine.following(plan)


class Trainer:
    """The training loop, from the current global step to the plan's last, on the ranks of the moment."""

    def __init__(self, job, plan, state, data, outputs, data_cfg, optimization, checkpointing, ranks):
        """``data``: the data interface (hvd_sgd.data); ``outputs``: rank 0's files (training.outputs);
        the rest, the configuration's sections the loop follows (hvd_sgd.config)."""
        self.job, self.plan, self.state, self.data, self.outputs = job, plan, state, data, outputs
        self.data_cfg, self.optimization, self.checkpointing, self.ranks = data_cfg, optimization, checkpointing, ranks
        self.clock = StepClock()
        self.evaluations = []  # (step, epoch, accuracy, time) of each, for the summary

    def run(self, after_step=None):
        """Train to the last step (or the target accuracy), calling ``after_step(n)`` after each; the
        last test result (an evaluation of its own where no step was left)."""
        world, plan, seed = self.job.world, self.plan, self.data_cfg.seed
        first = int(self.state.step.numpy())
        indices, drawn = batches.rank_batches(plan, world.rank, seed, first,
                                              self.data.input_shape[:2] if self.data_cfg.augment else None)
        train_step = _TrainStep(self.state, plan.backward_passes,
                                models.smoothed_cross_entropy(self.optimization.label_smoothing),
                                self.data.step_batches(indices, world.threads, drawn))
        self.clock.start(first)
        self.progress = Progress(world, plan, self.clock, self.outputs, self.ranks.slow_rank_lag)
        try:
            result = self._steps(train_step, indices, first, after_step)
        except cli.Stopped:  # on a signal, with Horovod running: the timeline's file closes valid (after an
            self.outputs.stop_timeline()  # error Horovod may be gone, and its file with the process)
            raise
        self.outputs.stop_timeline()  # where the loop ended before the window did
        return result

    def _steps(self, train_step, indices, first, after_step):
        """The loop over this rank's ``indices``, from global step ``first``."""
        world, plan, watchdog = self.job.world, self.plan, self.job.watchdog
        target_accuracy, every = self.optimization.target_accuracy, self.checkpointing.checkpoint_every_steps
        result, next_check, n = None, first + 1, first
        for row in indices:
            self.outputs.timeline_before(n + 1)
            notes_times = sampled(n + 1, self.outputs.cfg.log_every_steps, plan.total_steps)
            with watchdog.tracing(first_call=not train_step.traced(notes_times)):
                step, counted = train_step.compiled(notes_times)
                called = time.time()
                with _named_by_this_rank(lambda: self.data.undecodable_train(row)):
                    loss, n, *graph_times = step()
                ended = time.time()
            n = int(n)  # the global step, as the step returns it: reading the variable would be an op more
            self.outputs.timeline_after(n)
            watchdog.progress(n)
            if after_step:
                after_step(n)
            self.clock.step_done(plan.global_batch, called, ended, graph_times[0].numpy() if graph_times else None,
                                 counted)
            last_step, epoch_end = n == plan.total_steps, n % plan.steps_per_epoch == 0
            checkpoint_due = last_step or epoch_end or (every and n % every == 0)
            if last_step or n % self.outputs.cfg.log_every_steps == 0:
                self._log_progress(n, loss)
            if last_step or epoch_end:
                result = self._evaluate(n)
            # The ranks compare stop requests after about 0.1 s of steps (an all-reduce of its own).
            stop_now = False
            if self.job.stop is not None and n >= next_check:
                stop_now, steps_to_next = self.job.stop.agreed(self.clock.seconds_per_step())
                next_check = n + steps_to_next
            if checkpoint_due or stop_now:
                self._save_checkpoint(n)
            if stop_now:  # the all-reduced request: every rank stops after this same step
                raise cli.Stopped(self._where_stopped(n))
            if result and target_accuracy and result["accuracy"] >= target_accuracy:
                world.log(f"Reached --target-accuracy {target_accuracy} at step {n}")
                break  # every rank has the same result, so every rank stops here
        return self.evaluate() if result is None else result  # None: resumed at the last step

    def evaluate(self):
        """The test result, the same on every rank. Every rank evaluates its own share of the test set,
        taken anew for the ranks of the moment (elastic): 1/N of the time (docs/design.md, "Evaluation")."""
        world = self.job.world
        shares = self.data.test_batches(world.rank, world.size, world.threads)
        with _named_by_this_rank(lambda: self.data.undecodable_test(world.rank, world.size)):
            return world.evaluate(self.state.model, shares, self.job.watchdog)

    def _where_stopped(self, n):
        stop, directory = self.job.stop, self.checkpointing.checkpoint_dir
        how = f"on {stop.signal}" if stop.signal else "on a signal to another rank"
        if not directory:
            return f"stopped {how} at step {n}/{self.plan.total_steps}; no --checkpoint-dir, so nothing was saved"
        return (f"stopped {how} at step {n}/{self.plan.total_steps}, checkpoint saved in {directory}: "
                f"the same command with --resume continues")

    def _log_progress(self, n, loss):
        # Loss-scaled, a step whose gradients overflowed is skipped, not a divergence.
        self.progress.report(n, loss, float(self.state.schedule.at_step(n)),
                             check_finite=precision.loss_scale(self.state.optimizer) is None)

    def _evaluate(self, n):
        world = self.job.world
        with self.clock.paused():
            world.average_statistics(self.state.model)  # what is tested, and every rank goes on with
            result = self.evaluate()
        self.evaluations.append(dict(step=n, epoch=self.plan.epoch(n), accuracy=result["accuracy"], time=time.time()))
        world.log(f"epoch {self.plan.epoch(n):.2f}: test accuracy {result['accuracy']:.4f}  "
                  f"test loss {result['loss']:.4f}")
        self.outputs.scalars(n, {"test/accuracy": result["accuracy"], "test/loss": result["loss"]})
        return result

    def _save_checkpoint(self, n):
        # Never checkpoint a diverged model.
        finite(float(tf.linalg.global_norm(self.state.model.trainable_variables)), "weights' norm", n)
        with self.clock.paused():
            self.outputs.save_checkpoint(n)


@contextlib.contextmanager
def _named_by_this_rank(undecodable):
    """A training or test image that does not read or decode (streamed data) is named by the rank that
    found it, while the others wait for it in a collective: ``undecodable()`` names it, or None."""
    try:
        yield
    except tf.errors.OpError:
        found = undecodable()
        if not found:  # not this rank's data (Horovod shut down after another rank failed, say)
            raise
        raise cli.RankError(found) from None


def train_elastically(trainer, commit_every_steps):
    """Workers may leave or join: Horovod rolls every rank back to the last commit, restarts the
    loop with the new set of ranks, and broadcasts the committed state from the new rank 0.

    Each (re)start plans anew for its ranks (global batch, peak rate), keeping the epoch's length
    in steps from the job's first start: a worker that joins later, at another size, takes it from
    rank 0 (it has not traced its training step yet)."""
    import horovod.tensorflow as hvd
    job, state = trainer.job, trainer.state
    elastic = hvd.elastic.TensorFlowKerasState(state.model, state.optimizer, step=int(state.step.numpy()),
                                               steps_per_epoch=trainer.plan.steps_per_epoch)

    def commit(n):
        elastic.step = n
        if n % commit_every_steps == 0:
            elastic.commit()

    @hvd.elastic.run
    def train(elastic):
        state.step.assign(elastic.step)
        trainer.plan = RunPlan.for_training(trainer.optimization, job.world.size, trainer.plan.num_examples,
                                            steps_per_epoch=elastic.steps_per_epoch)
        state.follow(trainer.plan)
        trainer.outputs.follow_chief()
        job.world.check_identical(state.variables(), "after the (re)start")
        job.world.log(f"hvd_sgd: elastic (re)start at step {elastic.step} with {job.world.size} rank(s)")
        return trainer.run(commit)

    return train(elastic)


class _TrainStep:
    """The compiled step, taking its batch itself (a tf.function binds and flattens its arguments in
    Python at every call, which a short step notices: docs/design.md, "The step"), in two graphs
    traced at their first call: the plain one, and the sampled one that also notes its
    progress.GRAPH_TIMES."""

    def __init__(self, state, backward_passes, loss, next_batch):
        self.state, self.backward_passes, self.loss, self.next_batch = state, backward_passes, loss, next_batch
        self.graphs = {}

    def traced(self, sampled):
        return sampled in self.graphs

    def compiled(self, sampled):
        """The graph to call; whether this call counts (not its first, which traces and optimizes it)."""
        if sampled not in self.graphs:
            self.graphs[sampled] = tf.function(lambda: self._step(sampled)).get_concrete_function()
            return self.graphs[sampled], False
        return self.graphs[sampled], True

    def _step(self, sampled):
        """The step's loss and the global step after it; sampled, its GRAPH_TIMES too."""
        model, optimizer, passes = self.state.model, self.state.optimizer, self.backward_passes
        start = tf.timestamp() if sampled else None
        with tf.control_dependencies([start] if sampled else []):
            images, labels = self.next_batch()  # inside the graph: no Python hop per batch
        if sampled:
            with tf.control_dependencies([images, labels]):
                input_ready = tf.timestamp()
            # The model waits for that time: a timestamp no op waits for runs when a thread is free,
            # and a rank's one thread goes on down the forward pass first.
            with tf.control_dependencies([input_ready]):
                images = tf.identity(images)
        losses = []
        # One micro-batch per backward pass: the optimizer accumulates, then all-reduces and applies once.
        for micro_images, micro_labels in zip(tf.split(images, passes), tf.split(labels, passes)):
            with (_TimedTape() if sampled else tf.GradientTape()) as tape:
                losses.append(self.loss(micro_labels, model(micro_images, training=True)))
            distributed.minimize(optimizer, losses[-1], model.trainable_variables, tape)
        outputs = (tf.add_n(losses) / passes, self.state.step.assign_add(1))
        return outputs + (tf.stack([start, input_ready, tape.computed_at]),) if sampled else outputs


class _TimedTape(tf.GradientTape):
    """A tape that notes, in the step's graph, when the gradients it gave were all computed: where
    this rank's compute ends and the all-reduce (Horovod's, or hvd_sgd's wrapper's, both after the
    gradients) with its wait for the other ranks begins. The optimizer asks it for the gradients."""

    def gradient(self, target, sources, *args, **kwargs):
        gradients = super().gradient(target, sources, *args, **kwargs)
        computed = [g for g in tf.nest.flatten(gradients, expand_composites=True) if g is not None]
        with tf.control_dependencies(computed):
            self.computed_at = tf.timestamp()
        return gradients
