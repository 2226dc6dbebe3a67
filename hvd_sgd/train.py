"""Train with synchronous data-parallel SGD over Horovod.

    horovodrun -np 4 python -m hvd_sgd.train
    mpirun -np 4 python -m hvd_sgd.train
    python -m hvd_sgd.train                      (one rank)

Every step each rank computes the gradient of its own slice of the global batch, Horovod
averages the gradients by ring all-reduce, and every rank applies the same average: N ranks
with batch B train like one rank with batch N*B (at the same learning rate). Rank 0 evaluates,
logs and writes files. ``fit`` is the recipe, for your own model and data too.
"""
import contextlib
import dataclasses
import functools
import importlib.metadata
import math
import os
import platform
import time

import tensorflow as tf

from hvd_sgd import (JobError, __version__, batches, checkpoint, config, datasets, distributed, files, models,
                     preemption, schedules, shared_data, startup)
from hvd_sgd.watchdog import Watchdog

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def main(argv=None):
    cfg = config.parse(config.TrainConfig, argv, __doc__, speaks=startup.launch_rank() == 0, module="hvd_sgd.train")
    if not cfg.elastic:  # from now on a stop signal waits for fit's first check instead of ending the process
        preemption.listen(cfg.stall_timeout)
    world = _start(cfg)
    watchdog = _watchdog(world, cfg)
    with _together(world, cfg):  # a rank that cannot read the data, or import the model, stops them all
        with watchdog.file_work(datasets.location(cfg.dataset, cfg.data_dir)):  # slow reads are no stall
            # One copy a node: its first rank reads, the others map (elastic: no collectives yet).
            read = functools.partial(datasets.load, cfg.dataset, cfg.data_dir)
            splits = (read() if cfg.elastic else shared_data.load(read)).subset(cfg.train_examples, cfg.test_examples)
        model_fn = models.resolve(cfg.model)
    fit(model_fn, splits, cfg, world, watchdog)


def fit(model_fn, splits, cfg=config.TrainConfig(), world=None, watchdog=None):
    """Train ``model_fn(input_shape, num_classes)`` on ``splits`` (a datasets.Splits) as ``cfg``
    says, on every rank of the job; the run's summary (what ``--metrics-file`` holds)."""
    # 1. Start Horovod (unless the caller has): one GPU per rank by local rank, its share of the cores.
    world = world or _start(cfg)
    started = dict(world.started, data=time.time())  # where start-up's seconds go, for the summary
    import horovod.tensorflow as hvd  # its extension loads: startup.start checked it does
    watchdog = watchdog or _watchdog(world, cfg)
    # A signal stops every rank after the same step, with a checkpoint of it. Elastic mode: a
    # signalled worker is a lost one, and the others go on.
    stop = None if cfg.elastic else preemption.listen(cfg.stall_timeout)
    world.log(f"hvd_sgd: {world.size} rank(s) on {world.device}, {world.threads} thread(s) each, "
              f"model {getattr(model_fn, '__name__', cfg.model)}")

    # 2. Data: every rank holds the same splits and takes its own slice of each global batch.
    #    An epoch is this many steps for the whole run, even if an elastic job changes size.
    with _together(world, cfg):
        steps_per_epoch = batches.steps_per_epoch(len(splits.x_train), cfg.batch_size, world.size,
                                                  cfg.backward_passes_per_step)
        if world.is_chief:  # rank 0 writes the outputs: find out now, not after training, if it cannot
            for flag, path in (("--save-model", cfg.save_model), ("--metrics-file", cfg.metrics_file)):
                if path:
                    files.check_writable(files.parent(path), f"{flag} {path}")
            if cfg.log_dir:
                files.check_writable(cfg.log_dir, f"--log-dir {cfg.log_dir}")
        if cfg.elastic and distributed.KERAS_3:
            raise JobError("--elastic needs the default stack (Keras 2): Horovod 0.28.1's elastic state cannot "
                           "save or broadcast Keras 3 variables (README, \"Two stacks\")")
        if cfg.elastic and os.environ.get("HOROVOD_ELASTIC") != "1":
            raise JobError("--elastic needs horovodrun's elastic mode: horovodrun -np N --min-np MIN --max-np MAX "
                           "--host-discovery-script run/discover-hosts python -m hvd_sgd.train --elastic")
    total_steps, warmup_steps, decay_steps = _step_plan(cfg, steps_per_epoch)
    watchdog.progress()

    # 3. Scale the learning rate with the global batch (ranks x backward passes), ramping up to it
    #    over the warm-up epochs; decay it over --epochs (not --max-steps).
    passes = cfg.backward_passes_per_step
    lr = schedules.WarmupCosine(cfg.lr, passes if cfg.lr_scaling else 1, cfg.lr_scaling,
                                warmup_steps, decay_steps, backward_passes_per_step=passes)

    # 4. Wrap SGD in hvd.DistributedOptimizer (hvd_sgd's own under Keras 3, where Horovod's does not
    #    average): its gradients are the average over all ranks (and over the backward passes of a
    #    step: it all-reduces once, after the last).
    model = models.build(model_fn, splits.input_shape, splits.num_classes, cfg.seed)
    if cfg.save_model:
        models.check_exportable(model, cfg.save_model)
    optimizer = distributed.DistributedOptimizer(
        tf.keras.optimizers.SGD(lr, momentum=cfg.momentum, nesterov=cfg.nesterov),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=passes)
    optimizer.build(model.trainable_variables)
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")

    # 5. Every rank starts from rank 0's variables: its initial ones, or its latest checkpoint.
    checkpoints = None
    with _together(world, cfg):
        if world.is_chief and cfg.checkpoint_dir:  # rank 0 alone reads and writes checkpoints
            with watchdog.file_work(cfg.checkpoint_dir):  # the others wait: a slow file system is no stall
                # Slurm requeued this job (after a stop, a node failure, preemption): --resume is implied.
                requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0
                checkpoints = checkpoint.Checkpoints(cfg.checkpoint_dir, cfg.resume or requeued, world.log,
                                                     cfg.batch_size * passes * world.size,
                                                     model=model, optimizer=optimizer, step=step)
                if cfg.resume or (requeued and checkpoints.manager.checkpoints):
                    if not cfg.resume:
                        world.log(f"Slurm requeued job {os.environ.get('SLURM_JOB_ID')} (restart "
                                  f"{os.environ['SLURM_RESTART_COUNT']}): resuming, as --resume would")
                    checkpoints.restore_latest()
    state = distributed.tf_variables(model.variables + optimizer.variables) + [step]
    if not cfg.elastic:  # elastic: hvd.elastic.run broadcasts rank 0's state at every (re)start
        hvd.broadcast_variables(state, root_rank=0)
        world.check_identical(state, "after the broadcast")
    watchdog.progress()
    started["model"] = time.time()

    # 6. Train. The data order depends on (seed, epoch, global batch) only, so a resumed run
    #    sees exactly the batches the uninterrupted run would have seen.
    trainer = Trainer(world, cfg, splits, model, optimizer, step, lr, checkpoints, steps_per_epoch, total_steps,
                      watchdog, stop)
    result = _train_elastically(trainer, state) if cfg.elastic else trainer.run()
    if result is None:  # resumed at the last step: nothing was left to train
        result = world.evaluate(model, trainer.test_batches, watchdog.progress)
    started.update(first_step=trainer.clock.first_step_at, training=time.time())
    checksums = world.check_identical(state, "at the end")
    placement = hvd.allgather_object(world.placement())  # where each rank ran: host, local rank, …
    watchdog.stop()  # the last collective is done: a large model's export may take long

    # 7. Finish: the ranks agree bit for bit (above); rank 0 writes the model and the summary.
    steps_done, steps_per_epoch = int(step.numpy()), trainer.steps_per_epoch
    summary = dict(
        test_accuracy=result["accuracy"], test_loss=result["loss"], epochs=steps_done / steps_per_epoch,
        steps=steps_done, steps_per_epoch=steps_per_epoch, world_size=world.size, per_rank_batch=cfg.batch_size,
        backward_passes_per_step=passes, global_batch=trainer.global_batch(),
        learning_rate=cfg.lr * (world.size * passes if cfg.lr_scaling else 1),
        images_per_second=trainer.clock.images_per_second(), wall_seconds=trainer.clock.wall_seconds(),
        timeline=started, evaluations=trainer.evaluations, weight_checksums=checksums, ranks=placement,
        config=dataclasses.asdict(cfg),
        versions=dict(python=platform.python_version(), tensorflow=tf.__version__,
                      horovod=importlib.metadata.version("horovod"), hvd_sgd=__version__))
    if world.is_chief:  # one copy of each file, from the rank that holds what every rank holds
        if cfg.save_model:
            models.export(model, cfg.save_model)
            world.log(f"Model saved to {cfg.save_model}")
        if cfg.metrics_file:
            files.write_json(cfg.metrics_file, summary)
    world.log(f"Test accuracy: {result['accuracy']:.4f}")
    return summary


def _start(cfg):
    """startup.start as ``cfg`` says. hvd_sgd's watchdog, not Horovod's stall check, ends a stalled
    job; elastic mode runs no watchdog and keeps Horovod's check."""
    return startup.start(cfg.threads_per_rank, cfg.stall_timeout if cfg.elastic else None, cfg.bind_cpus)


def _watchdog(world, cfg):
    """From here on a frozen rank, or a hung file system, ends the job. Elastic mode: Horovod
    handles lost workers (a watchdog that watches nothing)."""
    return Watchdog(world, None if cfg.elastic else cfg.stall_timeout).start()


def _together(world, cfg):
    """A block whose JobError on any rank stops every rank (world.agreement). Not in elastic mode:
    a worker that joins mid-run first meets the others in the broadcast that (re)starts training,
    so no rank may enter a collective before it; a worker failing a check alone leaves the job."""
    return contextlib.nullcontext() if cfg.elastic else world.agreement()


def _step_plan(cfg, steps_per_epoch):
    """The run's last step, and the schedule's warm-up and decay lengths, in steps."""
    return (min(cfg.epochs * steps_per_epoch, cfg.max_steps or math.inf), round(cfg.warmup_epochs * steps_per_epoch),
            cfg.epochs * steps_per_epoch if cfg.lr_decay == "cosine" else 0)


class Trainer:
    """The training loop, from the current global step to the last, on the ranks of the moment."""

    def __init__(self, world, cfg, splits, model, optimizer, step, lr, checkpoints, steps_per_epoch, total_steps,
                 watchdog, stop=None):
        self.world, self.cfg, self.splits, self.model, self.step, self.lr = world, cfg, splits, model, step, lr
        self.optimizer, self.checkpoints, self.watchdog, self.stop = optimizer, checkpoints, watchdog, stop
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.test_batches = batches.test_batches(splits)
        self.clock = StepClock()
        self.evaluations = []  # (step, epoch, accuracy, time) of each, for the summary
        # TensorBoard files, like every file, are rank 0's.
        self.summaries = tf.summary.create_file_writer(cfg.log_dir) if world.is_chief and cfg.log_dir else None

    def set_steps_per_epoch(self, steps_per_epoch):
        """Before the loop runs (the schedule's lengths are traced into its step)."""
        self.steps_per_epoch = steps_per_epoch
        self.total_steps, self.lr.warmup_steps, self.lr.decay_steps = _step_plan(self.cfg, steps_per_epoch)

    def global_batch(self):
        return self.cfg.batch_size * self.cfg.backward_passes_per_step * self.world.size

    def run(self, after_step=None):
        """Train to the last step (or the target accuracy), calling ``after_step(n)`` after each; the
        last test result, None if no step was left."""
        first = int(self.step.numpy())
        rank_batch = self.cfg.batch_size * self.cfg.backward_passes_per_step
        indices = batches.rank_batch_indices(len(self.splits.x_train), rank_batch, self.world.size, self.world.rank,
                                             self.cfg.seed, first, self.total_steps, self.steps_per_epoch)
        train_step = _make_train_step(self.model, self.optimizer, self.step, self.cfg.backward_passes_per_step,
                                      models.smoothed_cross_entropy(self.cfg.label_smoothing),
                                      batches.step_batches(self.splits, indices))
        self.clock.start(first)
        result, next_check = None, first + 1
        for _ in range(first, self.total_steps):
            loss, n = train_step()
            n = int(n)  # the global step, as the step returns it: reading the variable would be an op more
            self.watchdog.progress(n)
            if after_step:
                after_step(n)
            self.clock.step_done(self.global_batch())
            last_step, epoch_end = n == self.total_steps, n % self.steps_per_epoch == 0
            every = self.cfg.checkpoint_every_steps
            checkpoint_due = last_step or epoch_end or (every and n % every == 0)
            if last_step or n % self.cfg.log_every_steps == 0:
                self._log_progress(n, loss)
            if last_step or epoch_end:
                result = self._evaluate(n)
            # The ranks compare stop requests after about 0.1 s of steps (an all-reduce of its own).
            stop_now = False
            if self.stop is not None and n >= next_check:
                stop_now, steps_to_next = self.stop.agreed(self.clock.seconds_per_step())
                next_check = n + steps_to_next
            if checkpoint_due or stop_now:
                self._save_checkpoint(n)
            if stop_now:  # the all-reduced request: every rank stops after this same step
                raise preemption.Stopped(self._where_stopped(n))
            if result and self.cfg.target_accuracy and result["accuracy"] >= self.cfg.target_accuracy:
                self.world.log(f"Reached --target-accuracy {self.cfg.target_accuracy} at step {n}")
                break  # every rank has the same result, so every rank stops here
        return result

    def _where_stopped(self, n):
        how = f"on {self.stop.signal}" if self.stop.signal else "on a signal to another rank"
        if not self.cfg.checkpoint_dir:
            return f"stopped {how} at step {n}/{self.total_steps}; no --checkpoint-dir, so nothing was saved"
        return (f"stopped {how} at step {n}/{self.total_steps}, checkpoint saved in {self.cfg.checkpoint_dir}: "
                f"the same command with --resume continues")

    def _log_progress(self, n, loss):
        import horovod.tensorflow as hvd
        loss = _finite(float(hvd.allreduce(loss)), "loss", n)  # every rank takes part in the average
        rate, eta = self.clock.images_per_second(), self.clock.eta(n, self.total_steps)
        self.world.log(f"step {n}/{self.total_steps}  epoch {n / self.steps_per_epoch:.2f}  loss {loss:.4f}  "
                       f"lr {float(self.lr.at_step(n)):.4g}  {rate:.0f} img/s  "
                       f"elapsed {_minutes(self.clock.wall_seconds())}  ETA {_minutes(eta)}")
        if self.summaries:
            with self.summaries.as_default(step=n):
                tf.summary.scalar("train/loss", loss)
                tf.summary.scalar("train/images_per_second", rate)

    def _evaluate(self, n):
        with self.clock.paused():
            self.world.average_statistics(self.model)  # what rank 0 tests, and every rank goes on with
            result = self.world.evaluate(self.model, self.test_batches, self.watchdog.progress)
        self.evaluations.append(dict(step=n, epoch=n / self.steps_per_epoch, accuracy=result["accuracy"],
                                     time=time.time()))
        self.world.log(f"epoch {n / self.steps_per_epoch:.2f}: test accuracy {result['accuracy']:.4f}  "
                       f"test loss {result['loss']:.4f}")
        if self.summaries:
            with self.summaries.as_default(step=n):
                tf.summary.scalar("test/accuracy", result["accuracy"])
                tf.summary.scalar("test/loss", result["loss"])
        return result

    def _save_checkpoint(self, n):
        # Never checkpoint a diverged model.
        _finite(float(tf.linalg.global_norm(self.model.trainable_variables)), "weights' norm", n)
        if self.world.is_chief and self.checkpoints:  # rank 0 alone writes checkpoints
            with self.clock.paused(), self.watchdog.file_work(self.cfg.checkpoint_dir):
                self.checkpoints.save(n)


def _train_elastically(trainer, variables):
    """Workers may leave or join: Horovod rolls every rank back to the last commit, restarts the
    loop with the new set of ranks, and broadcasts the committed state from the new rank 0.

    The epoch's length in steps is the job's from its first start: a worker that joins later, at
    another size, takes it from rank 0 (it has not traced its training step yet)."""
    import horovod.tensorflow as hvd
    state = hvd.elastic.TensorFlowKerasState(trainer.model, trainer.model.optimizer, step=int(trainer.step.numpy()),
                                             steps_per_epoch=trainer.steps_per_epoch)

    def commit(n):
        state.step = n
        if n % trainer.cfg.commit_every_steps == 0:
            state.commit()

    @hvd.elastic.run
    def train(state):
        trainer.step.assign(state.step)
        if state.steps_per_epoch != trainer.steps_per_epoch:
            trainer.set_steps_per_epoch(state.steps_per_epoch)
        trainer.world.check_identical(variables, "after the (re)start")
        trainer.world.log(f"hvd_sgd: elastic (re)start at step {state.step} with {trainer.world.size} rank(s)")
        return trainer.run(commit)

    return train(state)


def _make_train_step(model, optimizer, step, backward_passes, loss, next_batch):
    """The compiled step, traced here, taking its batch itself: a tf.function binds and flattens
    its arguments in Python at every call, which a short step notices (docs/benchmarks.md)."""
    def train_step():
        """The step's loss, and the global step after it."""
        images, labels = next_batch()  # inside the graph: no Python hop per batch
        losses = []
        # One micro-batch per backward pass: the optimizer accumulates, then all-reduces and applies once.
        for micro_images, micro_labels in zip(tf.split(images, backward_passes), tf.split(labels, backward_passes)):
            with tf.GradientTape() as tape:
                losses.append(loss(micro_labels, model(micro_images, training=True)))
            optimizer.minimize(losses[-1], model.trainable_variables, tape=tape)
        return tf.add_n(losses) / backward_passes, step.assign_add(1)

    return tf.function(train_step).get_concrete_function()


def _finite(value, what, step):
    """Divergence check. Every rank sees the same value (an all-reduced loss, or identical
    weights), so every rank stops at the same step, and the last checkpoint stays the last good one."""
    if not math.isfinite(value):
        raise JobError(f"the {what} is {value} at step {step}: training diverged (try a lower --lr); "
                       f"no checkpoint was written from this step on")
    return value


def _minutes(seconds):
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


class StepClock:
    """Training throughput and progress times.

    Throughput counts from the end of the first step (which traces the graph) to the end of the
    latest one, and leaves out what runs inside ``paused()``: evaluations, checkpoints."""

    def __init__(self):
        self.created = time.perf_counter()
        self.images, self.seconds, self.timed_steps = 0, 0.0, 0
        self.last = self.first_step_at = None
        self.first_step = self.steps = 0

    def start(self, step):
        """A (re)start of the loop at global ``step``; its first step traces and is not timed."""
        self.last, self.first_step, self.steps = None, step, 0
        self.started = time.perf_counter()

    def step_done(self, images):
        now = time.perf_counter()
        self.first_step_at = self.first_step_at or time.time()  # the first step traces the graph
        if self.last is not None:
            self.images += images
            self.seconds += now - self.last
            self.timed_steps += 1
        self.last = now
        self.steps += 1

    @contextlib.contextmanager
    def paused(self):
        yield
        self.last = time.perf_counter()

    def images_per_second(self):
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def seconds_per_step(self):
        """The mean of the timed steps; 0 before the first."""
        return self.seconds / self.timed_steps if self.timed_steps else 0.0

    def wall_seconds(self):
        return time.perf_counter() - self.created

    def eta(self, step, total_steps):
        """Seconds left at the pace of this loop so far, evaluations included."""
        return (time.perf_counter() - self.started) / max(1, self.steps) * (total_steps - step)


def cli():
    startup.main_guard(main, "hvd_sgd.train")


if __name__ == "__main__":
    cli()
