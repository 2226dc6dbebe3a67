"""Train with synchronous data-parallel SGD over Horovod.

    horovodrun -np 4 python -m hvd_sgd.train
    mpirun -np 4 python -m hvd_sgd.train
    python -m hvd_sgd.train                      (one rank)

Every step each rank computes the gradient of its own slice of the global batch, Horovod
averages the gradients by ring all-reduce, and every rank applies the same average: N ranks
with batch B train like one rank with batch N*B (at the same learning rate). Every rank tests its
share of the test set; rank 0 reports, logs and writes files. ``fit`` is the recipe, for your own
model and data too.
"""
import dataclasses
import importlib.metadata
import os
import platform
import time

import tensorflow as tf

from hvd_sgd import (JobError, __version__, checkpoint, cli, config, distributed, files, loop, models, precision,
                     preemption, schedules, sources, startup)
from hvd_sgd.plan import RunPlan
from hvd_sgd.watchdog import Watchdog

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def main(argv=None):
    cfg = config.parse(config.TrainConfig, argv, __doc__, speaks=startup.launch_rank() == 0, module="hvd_sgd.train")
    job = start_job(cfg)
    with job.together():  # a rank that cannot read the data, or import the model, stops them all
        with job.watchdog.file_work(sources.location(cfg)):  # slow reads are no stall
            data = sources.load(cfg, job.world.log)
        model_fn = models.resolve(cfg.model)
    fit(model_fn, data, cfg, job)


def fit(model_fn, data, cfg=config.TrainConfig(), job=None):
    """Train ``model_fn(input_shape, num_classes)`` on ``data`` (a datasets.Splits of arrays, or a
    catalogs.ImageSet of image files) as ``cfg`` says, on every rank of the job; the run's summary
    (what ``--metrics-file`` holds)."""
    # 1. Start Horovod (unless the caller has): one GPU per rank by local rank, its share of the cores.
    job = job or start_job(cfg)
    world = job.world
    started = dict(world.started, data=time.time())  # where start-up's seconds go, for the summary
    import horovod.tensorflow as hvd  # its extension loads: startup.start checked it does
    world.log(f"hvd_sgd: {world.size} rank(s) on {world.device}, {world.threads} thread(s) each, "
              f"model {getattr(model_fn, '__name__', cfg.model)}")

    # 2. The run plan: global batch, steps per epoch and in all, warm-up, peak learning rate. Every
    #    rank takes its own slice of each global batch.
    with job.together():
        plan = RunPlan.for_training(cfg, world.size, data.num_train)
        if world.is_chief:  # rank 0 writes the outputs: find out now, not after training, if it cannot
            for flag, path in (("--save-model", cfg.save_model), ("--metrics-file", cfg.metrics_file)):
                if path:
                    files.check_writable(files.parent(path), f"{flag} {path}")
            if cfg.log_dir:
                files.check_writable(cfg.log_dir, f"--log-dir {cfg.log_dir}")
        if cfg.elastic and distributed.KERAS_3:
            raise JobError("--elastic needs the default stack (Keras 2): Horovod 0.28.1's elastic state cannot "
                           "save or broadcast Keras 3 variables (docs/guide.md, \"Two stacks\")")
        if cfg.elastic and os.environ.get("HOROVOD_ELASTIC") != "1":
            raise JobError("--elastic needs horovodrun's elastic mode: horovodrun -np N --min-np MIN --max-np MAX "
                           "--host-discovery-script run/discover-hosts python -m hvd_sgd.train --elastic")
    job.watchdog.progress()

    # 3. The learning rate scales with the global batch (ranks x backward passes), ramping up to it
    #    over the warm-up epochs, and decays over --epochs (not --max-steps): the plan's schedule.
    schedule = schedules.WarmupCosine.following(plan)

    # 4. Wrap SGD in hvd.DistributedOptimizer (hvd_sgd's own under Keras 3, where Horovod's does not
    #    average): its gradients are the average over all ranks (and over the backward passes of a
    #    step: it all-reduces once, after the last).
    #    In mixed precision the layers compute in bfloat16 or float16, the logits are float32, and
    #    float16's loss scale judges the averaged gradients, the same on every rank.
    precision.use(cfg.precision)
    model = precision.with_float32_logits(models.build(model_fn, data.input_shape, data.num_classes, cfg.seed),
                                          data.input_shape)
    if cfg.save_model:
        models.check_exportable(model, cfg.save_model)
    optimizer = distributed.DistributedOptimizer(
        precision.loss_scaled(tf.keras.optimizers.SGD(schedule, momentum=cfg.momentum, nesterov=cfg.nesterov),
                              cfg.precision),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=plan.backward_passes)
    optimizer.build(model.trainable_variables)
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    state = loop.State(model, optimizer, tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step"),
                       schedule)

    # 5. Every rank starts from rank 0's variables: its initial ones, or its latest checkpoint.
    checkpoints = None
    with job.together():
        if world.is_chief and cfg.checkpoint_dir:  # rank 0 alone reads and writes checkpoints
            with job.watchdog.file_work(cfg.checkpoint_dir):  # the others wait: a slow file system is no stall
                checkpoints = _open_checkpoints(cfg, plan, state, world.log)
    if not cfg.elastic:  # elastic: hvd.elastic.run broadcasts rank 0's state at every (re)start
        hvd.broadcast_variables(state.variables(), root_rank=0)
        world.check_identical(state.variables(), "after the broadcast")
    job.watchdog.progress()
    started["model"] = time.time()

    # 6. Train. The data order depends on (seed, epoch, global batch) only, so a resumed run
    #    sees exactly the batches the uninterrupted run would have seen.
    trainer = loop.Trainer(job, plan, state, data, checkpoints)
    result = loop.train_elastically(trainer) if cfg.elastic else trainer.run()
    if result is None:  # resumed at the last step: nothing was left to train
        result = trainer.evaluate()
    started.update(first_step=trainer.clock.first_step_at, training=time.time())
    checksums = world.check_identical(state.variables(), "at the end")
    placement = hvd.allgather_object(world.placement())  # where each rank ran: host, local rank, …
    job.watchdog.stop()  # the last collective is done: a large model's export may take long

    # 7. Finish: the ranks agree bit for bit (above); rank 0 writes the model and the summary.
    plan, steps_done = trainer.plan, int(state.step.numpy())  # the plan of the last ranks, if elastic
    summary = dict(
        test_accuracy=result["accuracy"], test_loss=result["loss"], epochs=plan.epoch(steps_done),
        steps=steps_done, steps_per_epoch=plan.steps_per_epoch, world_size=plan.world_size,
        per_rank_batch=plan.per_rank_batch, backward_passes_per_step=plan.backward_passes,
        global_batch=plan.global_batch, learning_rate=plan.peak_lr, precision=cfg.precision,
        loss_scale=precision.loss_scale(optimizer),
        images_per_second=trainer.clock.images_per_second(), wall_seconds=trainer.clock.wall_seconds(),
        test_correct=result["correct"], test_examples=result["examples"], classes=getattr(data, "class_names", None),
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


def _open_checkpoints(cfg, plan, state, log):
    """Rank 0's checkpoints in --checkpoint-dir, with the latest restored into ``state`` on --resume
    (the caller broadcasts it). A job that Slurm requeued (after a stop, a node failure,
    preemption) resumes as --resume would."""
    requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0
    checkpoints = checkpoint.Checkpoints(cfg.checkpoint_dir, cfg.resume or requeued, log, plan.global_batch,
                                         model=state.model, optimizer=state.optimizer, step=state.step)
    if cfg.resume or (requeued and checkpoints.manager.checkpoints):
        if not cfg.resume:
            log(f"Slurm requeued job {os.environ.get('SLURM_JOB_ID')} (restart "
                f"{os.environ['SLURM_RESTART_COUNT']}): resuming, as --resume would")
        checkpoints.restore_latest()
    return checkpoints


def start_job(cfg):
    """The job as ``cfg`` says: from here on a signal stops every rank after the same step, with a
    checkpoint of it (elastic mode: a signalled worker is a lost one, and the others go on); Horovod
    starts; a frozen rank, or a hung file system, ends the job. hvd_sgd's watchdog, not Horovod's
    stall check, watches for stalls; elastic mode runs none (Horovod handles lost workers) and
    keeps Horovod's check."""
    stop = None if cfg.elastic else preemption.listen(cfg.stall_timeout)
    world = startup.start(cfg.threads_per_rank, cfg.stall_timeout if cfg.elastic else None, cfg.bind_cpus)
    return loop.Job(world, cfg, Watchdog(world, None if cfg.elastic else cfg.stall_timeout).start(), stop)


def console_script():
    cli.run(main, "hvd_sgd.train")


if __name__ == "__main__":
    console_script()
