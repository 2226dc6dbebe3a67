"""Train with synchronous data-parallel SGD over Horovod.

    horovodrun -np 4 python -m hvd_sgd.train
    mpirun -np 4 python -m hvd_sgd.train
    python -m hvd_sgd.train                      (one rank)

Every step each rank computes the gradient of its own slice of the global batch, Horovod
averages the gradients by ring all-reduce, and every rank applies the same average: N ranks
with batch B train like one rank with batch N*B. Rank 0 evaluates, logs and writes files.
"""
import contextlib
import dataclasses
import importlib.metadata
import math
import os
import platform
import time

import tensorflow as tf

from hvd_sgd import JobError, __version__, checkpoint, config, data, models, schedules, watchdog, world

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def main(argv=None):
    cfg = config.parse(config.TrainConfig, argv, __doc__, speaks=world.launch_rank() == 0)

    # 1. Start Horovod; pin one GPU per rank (by local rank) and bind the rank to its share of the cores.
    w = world.start(cfg.threads_per_rank, cfg.stall_timeout, cfg.bind_cpus)
    import horovod.tensorflow as hvd
    dog = watchdog.Watchdog(w, None if cfg.elastic else cfg.stall_timeout).start()  # a frozen rank ends the job
    w.log(f"hvd_sgd: {w.size} rank(s) on {w.device}, {w.threads} thread(s) each, model {cfg.model}")

    # 2. Data: every rank reads the same dataset and takes its own slice of each global batch.
    with w.agreement():
        dataset = data.load(cfg.dataset, cfg.data_dir).subset(cfg.train_examples, cfg.test_examples)
        steps_per_epoch = data.steps_per_epoch(len(dataset.x_train), cfg.batch_size, w.size)
        w.check_writable(cfg.save_model, cfg.metrics_file)
        if cfg.elastic and os.environ.get("HOROVOD_ELASTIC") != "1":
            raise JobError("--elastic needs horovodrun's elastic mode: horovodrun -np N --min-np MIN --max-np MAX "
                           "--host-discovery-script run/discover-hosts python -m hvd_sgd.train --elastic")
    total_steps = min(cfg.epochs * steps_per_epoch, cfg.max_steps or math.inf)
    dog.progress()

    # 3. Scale the learning rate by the number of ranks (the global batch grew by as much),
    #    ramping up to it over the warm-up epochs; decay it over --epochs (not --max-steps).
    lr = schedules.WarmupCosine(cfg.lr, cfg.lr_scaling, warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
                                decay_steps=cfg.epochs * steps_per_epoch if cfg.lr_decay == "cosine" else 0)

    # 4. Wrap SGD in hvd.DistributedOptimizer: its gradients are the average over all ranks.
    model = models.build(cfg.model, dataset.image_shape, cfg.seed)
    optimizer = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(lr, momentum=cfg.momentum),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=cfg.backward_passes_per_step)
    optimizer.build(model.trainable_variables)
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")

    # 5. Every rank starts from rank 0's variables: its initial ones, or its latest checkpoint.
    with w.agreement():
        checkpoints = checkpoint.Checkpoints(cfg.checkpoint_dir, w, cfg.resume,
                                             model=model, optimizer=optimizer, step=step)
        if cfg.resume:
            checkpoints.restore_latest()
    state = model.variables + optimizer.variables + [step]
    hvd.broadcast_variables(state, root_rank=0)
    w.check_identical(state, "after the broadcast")
    dog.progress()

    # 6. Train. The data order depends on (seed, epoch, global batch) only, so a resumed run
    #    sees exactly the batches the uninterrupted run would have seen.
    test_batches = data.test_batches(dataset)
    train_step = _make_train_step(model, optimizer, step)
    report = _Report(w, cfg, lr, total_steps)

    def train(after_step):
        """From the current global step to the last, with the current ranks; the last test result."""
        per_epoch = data.steps_per_epoch(len(dataset.x_train), cfg.batch_size, w.size)
        batches = data.train_batches(dataset, data.rank_batch_indices(
            len(dataset.x_train), cfg.batch_size, w.size, w.rank, cfg.seed, int(step.numpy()), total_steps))
        result = None
        batch_iterator = iter(batches)
        for _ in range(int(step.numpy()), total_steps):
            loss = train_step(batch_iterator)
            n = int(step.numpy())
            after_step(n)
            report.step_done(n)
            if n % cfg.log_every_steps == 0 or n == total_steps:
                report.train(n, n / per_epoch, _finite(float(hvd.allreduce(loss)), "loss", n))
            epoch_end = n % per_epoch == 0
            if epoch_end or n == total_steps:
                with report.paused():
                    result = report.test(n, n / per_epoch, w.evaluate(model, test_batches))
            if epoch_end or n == total_steps or (cfg.checkpoint_every_steps and n % cfg.checkpoint_every_steps == 0):
                _finite(_weight_norm(model), "weights' norm", n)  # never checkpoint a diverged model
                with report.paused():
                    checkpoints.save(n)
            if result and cfg.target_accuracy and result["accuracy"] >= cfg.target_accuracy:
                w.log(f"Reached --target-accuracy {cfg.target_accuracy} at step {n}")
                break  # every rank has the same result, so every rank stops here
        return result

    if cfg.elastic:
        # Workers may leave or join: Horovod rolls every rank back to the last commit, restarts
        # with the new set of ranks, and broadcasts the committed state from the new rank 0.
        elastic_state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=int(step.numpy()))

        def commit(n):
            elastic_state.step = n
            if n % cfg.commit_every_steps == 0:
                elastic_state.commit()

        @hvd.elastic.run
        def train_elastically(state):
            step.assign(state.step)
            w.log(f"hvd_sgd: elastic (re)start at step {state.step} with {w.size} rank(s)")
            return train(commit)

        result = train_elastically(elastic_state)
    else:
        result = train(dog.progress)
    checksums = w.check_identical(state, "at the end")

    # 7. Finish: the ranks agreed bit for bit (above); rank 0 writes the model and the summary.
    if result is None:  # resumed at the last step: nothing was left to train
        result = w.evaluate(model, test_batches)
    w.save_model(model, cfg.save_model)
    steps_done = int(step.numpy())
    w.write_json(cfg.metrics_file, dict(
        test_accuracy=result["accuracy"], test_loss=result["loss"],
        epochs=steps_done / steps_per_epoch, steps=steps_done, world_size=w.size,
        per_rank_batch=cfg.batch_size, global_batch=cfg.batch_size * w.size,
        learning_rate=cfg.lr * (w.size if cfg.lr_scaling else 1),
        images_per_second=report.images_per_second(steps_done), wall_seconds=report.wall_seconds(),
        weight_checksums=checksums, config=dataclasses.asdict(cfg),
        versions=dict(python=platform.python_version(), tensorflow=tf.__version__,
                      horovod=importlib.metadata.version("horovod"), hvd_sgd=__version__)))
    w.log(f"Test accuracy: {result['accuracy']:.4f}")


def _make_train_step(model, optimizer, step):
    @tf.function
    def train_step(batch_iterator):
        images, labels = next(batch_iterator)  # inside the graph, as Keras' fit does: no Python hop per batch
        with tf.GradientTape() as tape:
            loss = LOSS(labels, model(images, training=True))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)  # all-reduces the gradients
        step.assign_add(1)
        return loss

    return train_step


def _weight_norm(model):
    return float(tf.linalg.global_norm(model.trainable_variables))


def _finite(value, what, step):
    """Divergence check. Every rank sees the same value (an all-reduced loss, or identical
    weights), so every rank stops at the same step, and the last checkpoint stays the last good one."""
    if not math.isfinite(value):
        raise JobError(f"the {what} is {value} at step {step}: training diverged (try a lower --lr); "
                       f"no checkpoint was written from this step on")
    return value


class _Report:
    """Rank 0's progress lines and TensorBoard scalars, and the training throughput.

    Throughput counts from the end of the first step (which traces the graph) to the end of the
    latest one, and leaves out the time spent evaluating and writing checkpoints."""

    def __init__(self, world, cfg, lr, total_steps):
        self.world, self.cfg, self.lr, self.total_steps = world, cfg, lr, total_steps
        self.summaries = world.summary_writer(cfg.log_dir)
        self.created = time.perf_counter()
        self.first_timed_step = self.clock = None
        self.seconds = 0.0  # training time since the first step ended

    def step_done(self, step):
        now = time.perf_counter()
        if self.first_timed_step is None:
            self.first_timed_step = step
        else:
            self.seconds += now - self.clock
        self.clock = now

    def train(self, step, epoch, loss):
        rate = self.images_per_second(step)
        self.world.log(f"step {step}/{self.total_steps}  epoch {epoch:.2f}  loss {loss:.4f}  "
                       f"lr {float(self.lr(step)):.4g}  {rate:.0f} img/s")
        with self.summaries.as_default(step=step):
            tf.summary.scalar("train/loss", loss)
            tf.summary.scalar("train/images_per_second", rate)

    def test(self, step, epoch, result):
        self.world.log(f"epoch {epoch:.2f}: test accuracy {result['accuracy']:.4f}  "
                       f"test loss {result['loss']:.4f}")
        with self.summaries.as_default(step=step):
            tf.summary.scalar("test/accuracy", result["accuracy"])
            tf.summary.scalar("test/loss", result["loss"])
        return result

    def images_per_second(self, step):
        global_batch = self.cfg.batch_size * self.world.size
        return (step - self.first_timed_step) * global_batch / self.seconds if self.seconds > 0 else 0.0

    def wall_seconds(self):
        return time.perf_counter() - self.created

    @contextlib.contextmanager
    def paused(self):
        yield
        self.clock = time.perf_counter()


def cli():
    world.main_guard(main, "hvd_sgd.train")


if __name__ == "__main__":
    cli()
