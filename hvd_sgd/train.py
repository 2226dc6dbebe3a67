"""Train with synchronous data-parallel SGD over Horovod.

    horovodrun -np 4 python -m hvd_sgd.train
    mpirun -np 4 python -m hvd_sgd.train
    python -m hvd_sgd.train                      (one rank)

Every step each rank computes the gradient of its own slice of the global batch, Horovod
averages the gradients by ring all-reduce, and every rank applies the same average: N ranks
with batch B train like one rank with batch N*B (at the same learning rate). Every rank tests its
share of the test set; rank 0 reports, logs and writes files. ``fit`` is the recipe, for your own
model and data too; "Horovod:" marks its data-parallel steps.
"""
import dataclasses
import importlib.metadata
import platform
import time

import tensorflow as tf

from hvd_sgd import __version__, config
from hvd_sgd.data import sources
from hvd_sgd.runtime import announced, cli, jobs
from hvd_sgd.training import distributed, loop, models, precision, schedules
from hvd_sgd.training.outputs import Outputs
from hvd_sgd.training.plan import RunPlan

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def main(argv=None):
    cfg = config.parse(config.TrainConfig, argv, __doc__, speaks=announced.is_chief(), module="hvd_sgd.train")
    with jobs.start(cfg.ranks, timeline=bool(cfg.timeline)) as job:
        with job.together():  # a rank that cannot read the data, or import the model, stops them all
            with job.watchdog.file_work(sources.location(cfg.data)):  # slow reads are no stall
                data = sources.load(cfg.data, job.world, cfg.elastic)
            model_fn = models.resolve(cfg.model)
        fit(model_fn, data, cfg, job)


def fit(model_fn, data, cfg=config.TrainConfig(), job=None):
    """Train ``model_fn(input_shape, num_classes)`` on ``data`` as ``cfg`` says; the run's summary."""
    # 1. Horovod: start it (unless the caller has): one GPU per rank by local rank, its share of the cores.
    if job is None:  # a run of its own, whose watchdog ends with it
        with jobs.start(cfg.ranks, timeline=bool(cfg.timeline)) as job:
            return fit(model_fn, data, cfg, job)
    world, started = job.world, dict(job.world.started, data=time.time())  # start-up's phases, for the summary
    import horovod.tensorflow as hvd  # its extension loads: jobs.start checked it does

    # 2. The run plan: every rank takes its own slice of each global batch. Rank 0 checks its outputs now.
    outputs = Outputs(cfg.outputs, cfg.checkpointing, world, job.watchdog)
    with job.together():
        plan = RunPlan.for_training(cfg.optimization, world.size, data.num_train)
        outputs.check(plan)
        precision.check(cfg.numerics, world.device, precision.cpu_flags(), world.log)
    world.log(f"hvd_sgd: {world.size} rank(s) on {world.device}, {world.threads} thread(s) each, "
              f"model {getattr(model_fn, '__name__', cfg.model)}; {plan.describe()}")
    job.watchdog.progress()

    # 3. Horovod: the learning rate scales with the global batch, after a warm-up; it decays over --epochs.
    schedule = schedules.WarmupCosine.following(plan)

    # 4. Horovod: wrap SGD in hvd.DistributedOptimizer: every rank applies the gradients averaged over all
    #    ranks and a step's backward passes; a loss scale judges every rank's gradients at once.
    precision.use(cfg.precision)
    model = precision.with_float32_logits(models.build(model_fn, data.input_shape, data.num_classes, cfg.seed),
                                          data.input_shape)
    outputs.check_exportable(model)
    optimizer = distributed.DistributedOptimizer(
        precision.loss_scaled(tf.keras.optimizers.SGD(schedule, momentum=cfg.momentum, nesterov=cfg.nesterov),
                              cfg.precision),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=plan.backward_passes)
    optimizer.build(model.trainable_variables)
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    state = loop.State.starting(model, optimizer, schedule)

    # 5. Horovod: every rank starts from rank 0's variables: its initial ones, or its latest checkpoint.
    with job.together():
        outputs.open_checkpoints(plan, state)
    if not cfg.elastic:  # elastic: hvd.elastic.run broadcasts rank 0's state at every (re)start
        hvd.broadcast_variables(state.variables(), root_rank=0)
        world.check_identical(state.variables(), "after the broadcast")
    job.watchdog.progress()
    started["model"] = time.time()

    # 6. Train, in a data order of (seed, epoch, global batch) alone: a resumed run sees the same batches.
    trainer = loop.Trainer(job, plan, state, data, outputs, cfg.data, cfg.optimization, cfg.checkpointing, cfg.ranks)
    result = loop.train_elastically(trainer, cfg.commit_every_steps) if cfg.elastic else trainer.run()
    started.update(first_step=trainer.clock.first_step_at, training=time.time())

    # 7. Finish: the ranks agree bit for bit; rank 0 writes the model and the summary.
    checksums = world.check_identical(state.variables(), "at the end")
    placement = hvd.allgather_object(world.placement())  # where each rank ran: host, local rank, …
    job.watchdog.stop()  # the last collective is done: a large model's export may take long
    summary = _summary(cfg, trainer, data, result, timeline=started, weight_checksums=checksums, ranks=placement)
    outputs.finish(model, summary)
    world.log(f"Test accuracy: {result['accuracy']:.4f}")
    return summary


def _summary(cfg, trainer, data, result, timeline, weight_checksums, ranks):
    """The run's summary: what --metrics-file holds. The plan is the last ranks' (elastic)."""
    plan, steps_done = trainer.plan, int(trainer.state.step.numpy())
    return dict(
        test_accuracy=result["accuracy"], test_loss=result["loss"], epochs=plan.epoch(steps_done),
        steps=steps_done, steps_per_epoch=plan.steps_per_epoch, world_size=plan.world_size,
        per_rank_batch=plan.per_rank_batch, backward_passes_per_step=plan.backward_passes,
        global_batch=plan.global_batch, learning_rate=plan.peak_lr, precision=cfg.precision,
        loss_scale=precision.loss_scale(trainer.state.optimizer),
        images_per_second=trainer.clock.images_per_second(), wall_seconds=trainer.clock.wall_seconds(),
        test_correct=result["correct"], test_examples=result["examples"], classes=getattr(data, "class_names", None),
        timeline=timeline, evaluations=trainer.evaluations, weight_checksums=weight_checksums, ranks=ranks,
        config=dataclasses.asdict(cfg),
        versions=dict(python=platform.python_version(), tensorflow=tf.__version__,
                      horovod=importlib.metadata.version("horovod"), hvd_sgd=__version__))


def console_script():
    cli.run(main, "hvd_sgd.train")


if __name__ == "__main__":
    console_script()
