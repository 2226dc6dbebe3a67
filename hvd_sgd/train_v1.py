"""The classic TensorFlow 1 MNIST program, on Horovod instead of SyncReplicasOptimizer.

    horovodrun -np 2 python -m hvd_sgd.train_v1 --lr 0.5 --steps 300
    mpirun -np 2 python -m hvd_sgd.train_v1
    python -m hvd_sgd.train_v1                   (one rank)

Same structure as the original: placeholders, softmax regression with zero-initialised W and b,
GradientDescentOptimizer, hooks, MonitoredTrainingSession, a `while not should_stop()` loop and
the chief printing the test accuracy. What changed (docs/migrating-from-sync-replicas.md):
hvd.DistributedOptimizer replaces SyncReplicasOptimizer (each step applies the mean of all
replicas' gradients once), a hook that broadcasts rank 0's variables replaces the chief's
initialisation, and there are no parameter servers: mpirun or horovodrun starts the workers.
"""
import time

import numpy as np
import tensorflow as tf

from hvd_sgd import config
from hvd_sgd.data import batches, datasets
from hvd_sgd.runtime import announced, cli, startup
from hvd_sgd.training import checkpoint, files
from hvd_sgd.training.plan import RunPlan

tf1 = tf.compat.v1


def main(argv=None):
    cfg = config.parse(config.TrainV1Config, argv, __doc__, speaks=announced.is_chief(),
                       module="hvd_sgd.train_v1")
    w = startup.start()
    import horovod.tensorflow as hvd
    tf.get_logger().setLevel("ERROR")  # this program is the deprecated API: no deprecation warnings

    with w.agreement():
        splits = datasets.load(cfg.dataset, cfg.data_dir)
        n = len(splits.x_train)
        run_plan = RunPlan.build(world_size=w.size, num_examples=n, per_rank_batch=cfg.batch_size, lr=cfg.lr,
                                 lr_scaling=False, max_steps=cfg.steps)
        rank_batches = batches.rank_batch_indices(run_plan, w.rank, cfg.seed, 0)
        if w.is_chief:  # rank 0 writes the files: find out now if it cannot; one run per checkpoint directory
            if cfg.metrics_file:
                files.check_writable(files.parent(cfg.metrics_file), f"--metrics-file {cfg.metrics_file}")
            if cfg.checkpoint_dir:
                checkpoint.lock_directory(cfg.checkpoint_dir, f"--checkpoint-dir {cfg.checkpoint_dir}")
    w.log(f"hvd_sgd.train_v1: {w.size} rank(s), {w.threads} thread(s) each; {run_plan.describe()}")
    classes = splits.num_classes  # 10 for MNIST
    images, labels = _flat(splits.x_train), _one_hot(splits.y_train, classes)
    pixels = images.shape[1]  # 784 for MNIST

    # The set-up above ran eagerly (Horovod's checks need it); the TF1 program builds a graph.
    with tf.Graph().as_default():
        # The model of the original program.
        x = tf1.placeholder(tf.float32, [None, pixels], name="x")
        y_ = tf1.placeholder(tf.float32, [None, classes], name="y_")
        W = tf.Variable(tf.zeros([pixels, classes]), name="W")
        b = tf.Variable(tf.zeros([classes]), name="b")
        y = tf.matmul(x, W) + b
        cross_entropy = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y_, logits=y))
        global_step = tf1.train.get_or_create_global_step()

        # SyncReplicasOptimizer(opt, replicas_to_aggregate=N, total_num_replicas=N) becomes:
        opt = hvd.DistributedOptimizer(tf1.train.GradientDescentOptimizer(cfg.lr))
        train_op = opt.minimize(cross_entropy, global_step=global_step)
        correct = tf.equal(tf.argmax(y, 1), tf.argmax(y_, 1))
        accuracy = tf.reduce_mean(tf.cast(correct, tf.float32))

        # sync_replicas_hook becomes the broadcast of rank 0's variables (restored ones on a re-run).
        start = _RunAfterCreation(global_step)  # after the broadcast: the step every rank resumes at
        hooks = [_BroadcastGlobalVariables(root_rank=0), start, tf1.train.StopAtStepHook(last_step=cfg.steps)]
        if w.is_chief:  # as in the original program, the chief evaluates and reports
            test_accuracy = _RunAtEnd(accuracy, {x: _flat(splits.x_test), y_: _one_hot(splits.y_test, classes)})
            hooks.append(test_accuracy)
        session_config = tf1.ConfigProto(intra_op_parallelism_threads=w.threads,
                                         inter_op_parallelism_threads=min(2, w.threads))
        started = time.perf_counter()
        # Every rank is its own "chief" of its own graph; only rank 0 writes checkpoints and summaries.
        with tf1.train.MonitoredTrainingSession(checkpoint_dir=cfg.checkpoint_dir if w.is_chief else None,
                                               hooks=hooks, config=session_config) as mon_sess:
            first_step = step = start.value  # 0, or where the last checkpoint left off
            while not mon_sess.should_stop():
                batch = rank_batches[step]  # this rank's slice of global batch number `step`
                mon_sess.run(train_op, feed_dict={x: images[batch], y_: labels[batch]})
                step += 1
    seconds = time.perf_counter() - started
    if w.is_chief:  # as in the original program, the chief reports; it alone writes the summary
        if cfg.metrics_file:
            files.write_json(cfg.metrics_file, dict(
                test_accuracy=float(test_accuracy.value), steps=int(step), resumed_from_step=int(first_step),
                world_size=w.size, per_rank_batch=cfg.batch_size, learning_rate=cfg.lr, wall_seconds=seconds,
                images_per_second=(step - first_step) * run_plan.global_batch / seconds))
        w.log(f"Test accuracy: {test_accuracy.value:.4f}")


class _BroadcastGlobalVariables(tf1.train.SessionRunHook):
    """hvd.BroadcastGlobalVariablesHook, which Horovod 0.28.1 defines only where TensorFlow still
    has tf.estimator (up to 2.15): the same broadcast, on either stack."""

    def __init__(self, root_rank):
        self.root_rank = root_rank

    def begin(self):
        import horovod.tensorflow as hvd
        self.broadcast = hvd.broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.broadcast)


class _RunAfterCreation(tf1.train.SessionRunHook):
    """Evaluates a tensor once the session exists (after the hooks before it, the broadcast)."""

    def __init__(self, tensor, feed_dict=None):
        self.tensor, self.feed_dict, self.value = tensor, feed_dict, None

    def after_create_session(self, session, coord):
        self.value = session.run(self.tensor, self.feed_dict)


class _RunAtEnd(_RunAfterCreation):
    """Evaluates a tensor when the session ends (a MonitoredSession refuses runs after stopping)."""

    def after_create_session(self, session, coord):
        pass

    def end(self, session):
        self.value = session.run(self.tensor, self.feed_dict)


def _flat(images):
    return images.reshape(len(images), -1).astype(np.float32) / 255.0


def _one_hot(labels, classes):
    return np.eye(classes, dtype=np.float32)[labels]


def console_script():
    cli.run(main, "hvd_sgd.train_v1")


if __name__ == "__main__":
    console_script()
