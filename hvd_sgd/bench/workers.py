"""What the contender processes run: ``python -m hvd_sgd.bench worker KIND ARG…``.

Each worker measures one thing and its chief reports it through ``protocol.report``.
"""
import dataclasses
import functools
import json
import os
import statistics
import time

import numpy as np
import tensorflow as tf

from hvd_sgd import config
from hvd_sgd.data import batches, datasets
from hvd_sgd.runtime import announced, watchdog
from hvd_sgd.training import models, schedules
from hvd_sgd.bench import protocol
from hvd_sgd.training.plan import RunPlan, epochs_covering, per_rank_batch

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class StepTimer(tf.keras.callbacks.Callback):
    """Images per second over all batches but the first (which traces the graph)."""

    def __init__(self, batch_size):
        super().__init__()
        self.batch_size = batch_size

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.start = time.perf_counter()
        self.last, self.batches = time.perf_counter(), batch

    def images_per_second(self):
        return self.batches * self.batch_size / (self.last - self.start)


def _keras_setup(batch, steps, threads):
    """Threads, data and this worker's batch indices, as hvd_sgd would set them up for one rank.
    No TensorFlow op runs here: MultiWorkerMirroredStrategy must be created before the first."""
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
    splits = datasets.load("mnist")
    plan = RunPlan.build(world_size=1, num_examples=len(splits.x_train), per_rank_batch=batch, max_steps=steps)
    return splits, batches.rank_batch_indices(plan, 0, 1, 0)


def _compiled(model_name, splits):
    model = models.build(models.BUILT_IN[model_name], splits.input_shape, splits.num_classes, 1)
    model.compile(tf.keras.optimizers.SGD(0.01, momentum=0.9), LOSS)
    return model


def keras(model_name, batch, steps, threads):
    splits, indices = _keras_setup(batch, steps, threads)
    model, timer = _compiled(model_name, splits), StepTimer(batch)
    model.fit(batches.train_batches(splits, indices), epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    protocol.report(dict(images_per_second=timer.images_per_second()))


class Evaluations(tf.keras.callbacks.Callback):
    """When the first step ended, and each epoch's test accuracy with its time, as hvd_sgd records them."""

    def __init__(self, steps_per_epoch):
        super().__init__()
        self.steps_per_epoch, self.first_step_at, self.evaluations = steps_per_epoch, None, []

    def on_train_batch_end(self, batch, logs=None):
        self.first_step_at = self.first_step_at or time.time()

    def on_epoch_end(self, epoch, logs=None):
        self.evaluations.append(dict(step=(epoch + 1) * self.steps_per_epoch, epoch=epoch + 1,
                                     accuracy=logs["val_accuracy"], time=time.time()))


def keras_recipe(train_examples, test_examples, epochs, threads):
    """hvd_sgd's default recipe for one rank (model, batch, learning rate and its schedule, loss,
    data order) in plain Keras, evaluated after each epoch; reports what hvd_sgd's summary holds
    on the same: the evaluations and the start-up's timeline."""
    imported = time.time()
    cfg = config.TrainConfig()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
    splits = datasets.load(cfg.dataset).subset(train_examples, test_examples)
    data = time.time()
    plan = RunPlan.for_training(dataclasses.replace(cfg, epochs=epochs), 1, len(splits.x_train))
    indices = batches.rank_batch_indices(plan, 0, cfg.seed, 0)
    model = models.build(models.BUILT_IN[cfg.model], splits.input_shape, splits.num_classes, cfg.seed)
    model.compile(tf.keras.optimizers.SGD(schedules.WarmupCosine.following(plan), momentum=cfg.momentum,
                                          nesterov=cfg.nesterov),
                  models.smoothed_cross_entropy(cfg.label_smoothing), metrics=["accuracy"])
    built, evaluations = time.time(), Evaluations(plan.steps_per_epoch)
    model.fit(batches.train_batches(splits, indices), epochs=epochs, steps_per_epoch=plan.steps_per_epoch, verbose=0,
              validation_data=batches.test_batches(splits), callbacks=[evaluations])
    protocol.report(dict(test_accuracy=evaluations.evaluations[-1]["accuracy"], evaluations=evaluations.evaluations,
                         timeline=dict(imports=imported, horovod=imported, data=data, model=built,
                                       first_step=evaluations.first_step_at, training=time.time())))


def mwms(model_name, global_batch, steps, threads):
    """MultiWorkerMirroredStrategy's own training loop (TensorFlow's custom-loop recipe: the step under
    ``strategy.run`` in one tf.function), as a user of Keras 3 writes it: Keras 3's ``fit`` cannot run
    under this strategy (keras-team/keras#20585)."""
    splits, indices = _keras_setup(global_batch, steps, threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    with strategy.scope():
        model = models.build(models.BUILT_IN[model_name], splits.input_shape, splits.num_classes, 1)
        optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        per_example = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
    data = iter(strategy.experimental_distribute_dataset(batches.train_batches(splits, indices).with_options(options)))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example(y, model(x, training=True)), global_batch_size=global_batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def step(x, y):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(x, y)), axis=None)

    for done in range(steps):
        float(step(*next(data)))  # waits for the step, as a Keras callback's logs do
        if done == 0:  # the first step traces the graph
            start = time.perf_counter()
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        protocol.report(dict(images_per_second=(steps - 1) * global_batch / (time.perf_counter() - start)))


ALLREDUCE_BLOCK_SECONDS = 0.1


def allreduce(libraries, sizes, blocks):
    """Bus bandwidth of a float32 sum all-reduce, per size: hvd.allreduce and, with "horovod,mpi4py",
    mpi4py's Allreduce in the same processes, a timed block of each in turn.

    Both run the same chain, each all-reduce reducing the previous one's result (zeros, so the
    sums stay finite), as training reduces fresh gradients each step: hvd.allreduce in a compiled
    tf.function loop, as training runs it. mpi4py also reports the textbook loop that reduces one
    send buffer over and over (``mpi4py_fixed_buffers``). Per size: a warm-up, then ``blocks``
    timed blocks of about ALLREDUCE_BLOCK_SECONDS per loop, the loops in turn. Each library's
    bandwidth is the median over its blocks (a block that the machine's noise slowed does not
    count). The ratio hvd / mpi4py is the median of the ratios of blocks timed next to each other:
    on this machine how fast two processes copy to each other moves from minute to minute, so
    loops timed apart disagreed by more than the libraries do."""
    sizes = [int(s) for s in str(sizes).split(",")]
    loops, size, is_chief, from_rank_0 = _allreduce_loops(libraries.split(","))
    result = dict(sizes=sizes, **{key: [] for key in loops}, horovod_over_mpi4py=[])
    for nbytes in sizes:
        runs, iterations, seconds = {key: make(nbytes) for key, make in loops.items()}, {}, {key: [] for key in loops}
        for key, run in runs.items():
            run(2)  # traces the chain for this size and allocates its buffers
            start = time.perf_counter()
            run(5)  # sizes the blocks
            iterations[key] = from_rank_0(max(5, min(1000, int(ALLREDUCE_BLOCK_SECONDS * 5 /
                                                                (time.perf_counter() - start)))))  # as many on every rank
        for _ in range(int(blocks)):
            for key, run in runs.items():
                start = time.perf_counter()
                run(iterations[key])
                seconds[key].append((time.perf_counter() - start) / iterations[key])
        for key in loops:
            result[key].append(2 * (size - 1) / size * nbytes / statistics.median(seconds[key]) / 1e9)
        if "mpi4py" in seconds:
            result["horovod_over_mpi4py"].append(statistics.median(
                m / h for h, m in zip(seconds["horovod"], seconds["mpi4py"])))
    if is_chief:
        protocol.report(result)


def _allreduce_loops(libraries):
    """The chains of ``libraries`` by name, the world's size, whether this is rank 0, and a broadcast from it."""
    from hvd_sgd.runtime import startup
    world = startup.start(threads_per_rank=1)  # under mpirun, hvd.init on mpi4py's COMM_WORLD
    import horovod.tensorflow as hvd

    @tf.function
    def allreduce_chain(tensor, iterations):
        return tf.while_loop(lambda i, t: i < iterations, lambda i, t: (i + 1, hvd.allreduce(t, op=hvd.Sum)),
                             (tf.constant(0), tensor))[1]

    def horovod_chain(nbytes):
        tensor = tf.zeros(nbytes // 4, tf.float32)
        return lambda iterations: allreduce_chain(tensor, tf.constant(iterations)).numpy()

    def mpi_chain(nbytes, fixed):
        """Each Allreduce reduces the previous result or, ``fixed``, the same send buffer every time."""
        from mpi4py import MPI
        buffers = [np.zeros(nbytes // 4, np.float32) for _ in range(2)]

        def run(iterations):
            for i in range(iterations):
                source = 0 if fixed else i % 2
                MPI.COMM_WORLD.Allreduce(buffers[source], buffers[1 - source])
        return run

    loops = dict(horovod=horovod_chain)
    if "mpi4py" in libraries:
        loops.update(mpi4py=functools.partial(mpi_chain, fixed=False),
                     mpi4py_fixed_buffers=functools.partial(mpi_chain, fixed=True))
    return loops, world.size, world.is_chief, lambda n: hvd.broadcast_object(n, root_rank=0)


def decompose(model_name, global_batch, steps, threads, blocks):
    """Where hvd_sgd's step goes, on the ranks of one job: ``blocks`` blocks of each of three steps
    in turn (the order reversed every other block, so that the machine's drift falls on each alike),
    ``steps`` steps of each in all, every rank taking its slice of ``global_batch``:

    - "ceiling": the step with no all-reduce, each rank training on its own;
    - "together": the same step with the gradients averaged (one grouped all-reduce); both with
      timestamps inside the compiled step around its parts (bench/decomposition.py);
    - "hvd_sgd": ``hvd_sgd.train.fit`` itself on the same job, its own clock's images a second: its
      optimizer's all-reduces, its loop's checks.

    The chief reports every rank's timestamps and fit's figures."""
    from hvd_sgd import train
    from hvd_sgd.runtime import jobs
    import horovod.tensorflow as hvd
    per_block = max(5, steps // blocks)
    splits = datasets.load("mnist").subset(test_examples=500)  # fit evaluates after each block: briefly
    cfg = config.TrainConfig(model=model_name, batch_size=per_rank_batch(global_batch, announced.size()),
                             seed=1, max_steps=per_block,
                             epochs=epochs_covering(per_block, global_batch, splits.num_train),
                             threads_per_rank=threads, log_every_steps=10 ** 6)
    job = jobs.start(cfg.ranks)
    world = job.world
    plan = RunPlan.build(world_size=world.size, num_examples=splits.num_train, per_rank_batch=cfg.batch_size,
                         max_steps=(per_block + STEPS_TRACED) * blocks)
    loss = models.smoothed_cross_entropy(cfg.label_smoothing)

    def timed_step(together):
        next_batch = splits.step_batches(batches.rank_batch_indices(plan, world.rank, 1, 0), world.threads)
        model = models.build(models.BUILT_IN[model_name], splits.input_shape, splits.num_classes, 1)
        optimizer = tf.keras.optimizers.SGD(cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)  # fit's, at a fixed rate
        optimizer.build(model.trainable_variables)
        hvd.broadcast_variables(model.variables, root_rank=0)

        def step():
            start = tf.timestamp()
            with tf.control_dependencies([start]):
                images, labels = next_batch()
            with tf.GradientTape() as tape:
                value = loss(labels, model(images, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            with tf.control_dependencies(grads):
                computed = tf.timestamp()
            with tf.control_dependencies([computed]):
                grads = hvd.grouped_allreduce(grads, op=hvd.Average) if together else [tf.identity(g) for g in grads]
            with tf.control_dependencies(grads):
                reduced = tf.timestamp()
            with tf.control_dependencies([reduced]):
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return tf.stack([start, computed, reduced, tf.timestamp()])  # after the update: stateful ops keep their order

        traced = tf.function(step).get_concrete_function()
        for _ in range(STEPS_TRACED):  # the first steps trace and warm up
            traced()
        return traced

    timed = dict(ceiling=timed_step(False), together=timed_step(world.size > 1))
    kinds = ("ceiling", "together", "hvd_sgd")
    times, images_per_second = dict(ceiling=[], together=[]), []
    for block in range(blocks):
        for kind in kinds if block % 2 == 0 else kinds[::-1]:
            hvd.allreduce(tf.constant(0.0), name=f"block_{block}_{kind}")  # every rank starts it together
            if kind == "hvd_sgd":
                images_per_second.append(train.fit(models.BUILT_IN[model_name], splits, cfg, job)["images_per_second"])
            else:
                times[kind].append([timed[kind]().numpy().tolist() for _ in range(per_block)])
    every = hvd.allgather_object(dict(host=world.placement()["host"], **times))
    if world.is_chief:
        protocol.report(dict(ranks=every, hvd_sgd=images_per_second, global_batch=global_batch))


STEPS_TRACED = 10  # each timed step's first calls, untimed


def image_sets(directory, examples, test_examples, size, colour):
    """The input suite's data: the first ``examples`` MNIST training images and ``test_examples`` test images,
    resized to ``size`` pixels square, in colour if ``colour``, as arrays in an .npz and as JPEG
    image folders and TFRecord shards (hvd_sgd.data.convert), under ``directory``."""
    from hvd_sgd.data import convert
    mnist = datasets.load("mnist").subset(examples, test_examples)

    def converted(images):
        return np.stack([tf.io.decode_jpeg(convert.encoded(image, (size, size), bool(colour))[0]).numpy()
                         for image in images])
    np.savez(os.path.join(directory, "memory.npz"), x_train=converted(mnist.x_train), y_train=mnist.y_train,
             x_test=converted(mnist.x_test), y_test=mnist.y_test)
    for layout in convert.LAYOUTS:
        convert.export(mnist, os.path.join(directory, layout), layout, (size, size), bool(colour), shards=4)
    protocol.report(dict(done=True))


def decode(directory, threads):
    """Images per second that a tf.data pipeline of ``threads`` parallel calls reads and decodes
    from the image folder under ``directory`` (streamed, as hvd_sgd.train streams it), over its training set."""
    from hvd_sgd.data import sources
    image_set = sources.read(config.TrainConfig(data_dir=os.path.join(directory, "folder")).data)
    plan = RunPlan.build(world_size=1, num_examples=image_set.num_train, per_rank_batch=64, epochs=1)
    next_batch = image_set.step_batches(batches.rank_batch_indices(plan, 0, 1, 0), threads)
    next_batch()  # the pipeline starts
    started = time.perf_counter()
    for _ in range(plan.total_steps - 1):
        next_batch()
    protocol.report(dict(images_per_second=(plan.total_steps - 1) * 64 / (time.perf_counter() - started)))


def evaluation(data, model_name, repeats):
    """Seconds to evaluate the whole test set of ``data`` (mnist, fashion_mnist, an .npz, or image files,
    streamed) as hvd_sgd does, every rank its share (World.evaluate), and as rank 0 alone while the
    others wait, the two alternating, and each one's (correct, examples): run as the ranks of one
    job; the chief reports."""
    from hvd_sgd.data import sources
    from hvd_sgd.runtime import startup
    world = startup.start()
    import horovod.tensorflow as hvd
    named = data in config.DATASETS  # read as hvd_sgd.train reads --dataset or --data-dir
    data = sources.load(config.TrainConfig(**{"dataset" if named else "data_dir": data}).data, world)
    model = models.build(models.BUILT_IN[model_name], data.input_shape, data.num_classes, 1)
    hvd.broadcast_variables(model.variables, root_rank=0)
    whole = data.test_batches(threads=world.threads) if world.is_chief else []  # rank 0 alone: held
    seconds, correct, unwatched = {False: [], True: []}, {}, watchdog.Watchdog(world, None)
    for i in range(repeats + 1):  # the first round traces and warms up, and is not counted
        for together in ((False, True) if i % 2 == 0 else (True, False)):
            hvd.allreduce(tf.constant(0.0), name="evaluation_start")  # every rank starts together
            started = time.perf_counter()
            shares = data.test_batches(world.rank, world.size, world.threads) if together else whole
            result = world.evaluate(model, shares, unwatched)  # returns on every rank at once
            if i:
                seconds[together].append(time.perf_counter() - started)
            correct[together] = result["correct"], result["examples"]
    if world.is_chief:
        protocol.report(dict(alone=seconds[False], together=seconds[True], correct_alone=correct[False],
                             correct_together=correct[True]))


WORKERS = {"keras": keras, "keras_recipe": keras_recipe, "mwms": mwms, "allreduce": allreduce,
           "image_sets": image_sets, "decode": decode, "decompose": decompose, "evaluation": evaluation}
