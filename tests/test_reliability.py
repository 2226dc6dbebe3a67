"""Faults and bad input: real processes killed and stopped, damaged files, diverging runs.

Each bad input must give one line naming the problem, from one rank; a non-zero exit on every
rank; no hang; and no output left behind that looks valid."""
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import (LONG_RUN, LONG_STEPS, PYTHON, ROOT, assert_same_weights, checkpoint_from_step, ended_within,
                      Cgroup, error_lines, frozen, launch, output_lines, random_arrays, rank_exits, rank_process,
                      read_json, reported_accuracy, saved_weights, start_and_wait, succeeded, write_dataset, write_idx)
from hvd_sgd.bench import launchers
from hvd_sgd.runtime import mpirun, watchdog


# --- bad input ---------------------------------------------------------------------------

def idx_dir(tmp_path, damage=None):
    directory = tmp_path / "idx"
    directory.mkdir()
    write_dataset(directory, n_train=256, n_test=64)
    if damage:
        damage(directory)
    return ["--data-dir", directory]


IMAGES = "train-images-idx3-ubyte.gz"
LABELS = "train-labels-idx1-ubyte.gz"


def checkpoint_of_another_model(tmp_path):
    succeeded(launch("python", 1, "--model", "softmax", "--max-steps", 2, "--train-examples", 256,
                     "--test-examples", 64, "--checkpoint-dir", tmp_path / "ckpt"))
    return ["--model", "mlp", "--checkpoint-dir", tmp_path / "ckpt", "--resume"]


def checkpoint_index_pointing_outside(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "checkpoint").write_text('model_checkpoint_path: "/etc/ckpt-5"\n'
                                                  'all_model_checkpoint_paths: "/etc/ckpt-5"\n')
    return ["--checkpoint-dir", tmp_path / "ckpt", "--resume"]


def existing_checkpoints_without_resume(tmp_path):
    succeeded(launch("python", 1, "--model", "softmax", "--max-steps", 2, "--train-examples", 256,
                     "--test-examples", 64, "--checkpoint-dir", tmp_path / "ckpt"))
    return ["--checkpoint-dir", tmp_path / "ckpt"]


def damaged_idx(file, array, **damage):
    """A dataset directory whose ``file`` holds ``array`` (with the given damage)."""
    return lambda tmp_path: idx_dir(tmp_path, lambda d: write_idx(d / file, array, **damage))


def npz_file(**arrays):
    """An .npz dataset of MNIST's shape, with the given arrays instead of its own."""
    def data_dir(tmp_path):
        np.savez(tmp_path / "data.npz", **{**random_arrays(256, 64, (28, 28)), **arrays})
        return ["--data-dir", tmp_path / "data.npz"]
    return data_dir


def flags(*args):
    return lambda tmp_path: list(args)


# Flag values the configuration rejects before Horovod starts have their unit tests (test_config.py);
# two of them stand here for the whole path.
BAD_INPUT = {
    "missing data directory": (lambda t: ["--data-dir", t / "nowhere"], "no such directory"),
    "truncated IDX file": (damaged_idx(IMAGES, np.zeros((256, 4, 4)), cut=100), "truncated"),
    "wrong IDX magic": (damaged_idx(IMAGES, np.zeros((256, 4, 4)), magic=b"PK\3\4"), "bad magic number"),
    "image/label count mismatch": (damaged_idx(LABELS, np.zeros(255)), "256 images but 255 labels"),
    "negative label": (npz_file(y_train=np.full(256, -1)), "train label -1 is negative"),
    "batch size 0": (flags("--batch-size", 0), "--batch-size must be at least 1"),
    "batch larger than a shard": (flags("--train-examples", 256, "--batch-size", 200), "larger than a rank's shard"),
    "more ranks than examples": (flags("--train-examples", 1), "2 ranks but only 1 training examples"),
    "unknown model": (flags("--model", "lenet"), "invalid choice: 'lenet'"),
    "resume with another model's checkpoint": (checkpoint_of_another_model, "does not fit this model"),
    "resume with no checkpoint": (lambda t: ["--checkpoint-dir", t / "empty", "--resume"], "no readable checkpoint"),
    "checkpoint index pointing outside the directory": (checkpoint_index_pointing_outside, "no readable checkpoint"),
    "checkpoints there but no --resume": (existing_checkpoints_without_resume, "already holds checkpoints"),
    "checkpoint dir not writable": (flags("--checkpoint-dir", "/proc/hvd_sgd"),
                                    "rank 0: --checkpoint-dir /proc/hvd_sgd: cannot create"),
    "model path not writable": (flags("--save-model", "/proc/hvd_sgd/m.keras"),
                                "--save-model /proc/hvd_sgd/m.keras: cannot create"),
    "log dir a file": (lambda t: (t / "logs").touch() or ["--log-dir", t / "logs"], "/logs: cannot create"),
}


# The whole path, launcher to every rank's exit status, for the cases that need two ranks or a run
# before them (a checkpoint directory is this process's for its life); the others in this process.
END_TO_END = ("batch larger than a shard", "more ranks than examples", "resume with another model's checkpoint",
              "checkpoint index pointing outside the directory", "checkpoints there but no --resume",
              "checkpoint dir not writable")


def bad_run(case, tmp_path):
    """The case's flags with an output file of each kind it does not name, and its message."""
    make_args, message = BAD_INPUT[case]
    args = make_args(tmp_path)
    outputs = {"--metrics-file": tmp_path / "out" / "metrics.json", "--save-model": tmp_path / "out" / "model.keras"}
    outputs = {flag: path for flag, path in outputs.items() if flag not in map(str, args)}
    return ["--model", "softmax", "--max-steps", 3, *args, *[x for pair in outputs.items() for x in pair]], \
        outputs.values(), message


@pytest.mark.slow
@pytest.mark.parametrize("case", END_TO_END)
def test_bad_input(case, tmp_path):
    args, outputs, message = bad_run(case, tmp_path)
    exits = tmp_path / "exits"
    exits.mkdir()
    result = launch("mpirun", 2, *args, exits_dir=exits, timeout=120)
    errors = [line for line in output_lines(result.stderr) if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert errors[0].startswith("hvd_sgd.train: error: ")
    assert "Traceback" not in result.stdout + result.stderr
    statuses = rank_exits(exits)
    assert len(statuses) == 2 and all(statuses), statuses
    for path in outputs:
        assert not path.exists(), f"{path} was written"


@pytest.mark.parametrize("case", [case for case in BAD_INPUT if case not in END_TO_END])
def test_bad_input_in_this_process(case, tmp_path, capsys):
    """hvd_sgd.train's console script in this process, on one rank: one line, status 1, nothing
    written, and a process that goes on (the run's watchdog stopped with it)."""
    from hvd_sgd import train
    from hvd_sgd.runtime import cli
    args, outputs, message = bad_run(case, tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.run(lambda: train.main(list(map(str, args))), "hvd_sgd.train")
    errors = capsys.readouterr().err.splitlines()
    assert exited.value.code == cli.EXIT_FAILED and len(errors) == 1 and message in errors[0], errors
    assert errors[0].startswith("hvd_sgd.train: error: ")
    for path in outputs:
        assert not path.exists(), f"{path} was written"
    watching = lambda: [t for t in threading.enumerate() if t.name == "hvd_sgd-watchdog"]
    deadline = time.monotonic() + 3 * watchdog.BEAT_SECONDS  # it sees the stop at its next beat
    while watching() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not watching(), "the run's watchdog goes on watching after it"


@pytest.mark.slow
def test_the_error_line_is_not_lost_when_the_first_rank_starts_last():
    """mpirun ends the job as soon as one rank fails. The other ranks wait for the first one, which
    reports the error, even when it starts 3 s after them."""
    first_rank_late = ("sh", "-c", 'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then sleep 3; fi; exec "$@"', "sh")
    result = launch("mpirun", 2, "--epochs", 0, wrapper=first_rank_late, timeout=120)
    errors = [line for line in output_lines(result.stderr) if "error:" in line]
    assert result.returncode != 0 and errors == ["hvd_sgd.train: error: --epochs must be at least 1, got 0"], \
        result.stderr[-3000:]


# --- a rank dies, a rank stalls -----------------------------------------------------------------

def start_and_wait_for(launcher_name, args, ready, timeout=120):
    """Start a 2-rank run in the background; return it once ``ready()`` is true."""
    return start_and_wait(launchers.command(launcher_name, 2, "hvd_sgd.train", args), ready, timeout)


def assert_ends_naming(run, rank, stopped_at, stall_timeout, waiting_in):
    """The job ends, failed, within ``stall_timeout`` + 15 s of ``rank``'s freeze (SIGSTOP) at
    ``stopped_at``, with one line naming that rank, its host, its stopped process, and the file of
    the other rank's Python stacks, which shows it waiting in ``waiting_in`` (a function)."""
    status, stdout, stderr = ended_within(run, 60)
    assert status != 0 and time.monotonic() - stopped_at < stall_timeout + 15
    lines = [line for line in output_lines(stderr) if "hvd_sgd" in line]
    assert len(lines) == 1 and f"rank(s) {rank} ({os.uname().nodename}) stopped responding" in lines[0], stderr[-3000:]
    assert f"the process of rank(s) {rank} is stopped" in lines[0] and f"(none from rank(s) {rank})" in lines[0]
    stacks = Path(re.search(r"Python stacks in (\S+)", lines[0]).group(1))
    waiting = (stacks / f"rank-{1 - rank}.txt").read_text()
    assert f"rank {1 - rank} of 2" in waiting and f"in {waiting_in}" in waiting, waiting


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_killed_rank_ends_the_job_and_resume_loses_at_most_one_interval(launcher, uninterrupted, tmp_path):
    checkpoints = tmp_path / "ckpt"
    run = start_and_wait_for(launcher, [*LONG_RUN, "--checkpoint-dir", checkpoints], checkpoint_from_step(checkpoints, 100))
    psutil_run = psutil.Process(run.pid)
    victim = rank_process(psutil_run, 1)
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    status, stdout, stderr = ended_within(run, 60)
    assert status != 0 and time.monotonic() - killed_at < 60
    # One line names the rank, its host and its end (Open MPI's launcher, under horovodrun too); no
    # rank adds a traceback or an error of its own.
    naming = [line for line in output_lines(stderr) if "rank 1" in line]
    assert len(naming) == 1 and f"on node {os.uname().nodename} exited on signal 9" in naming[0], stderr[-3000:]
    assert "Traceback" not in stderr and not [line for line in output_lines(stderr) if "error:" in line], stderr[-3000:]
    last_logged = max(int(line.split()[1].split("/")[0]) for line in output_lines(stdout) if line.startswith("step "))
    assert last_logged < LONG_STEPS, "the run finished before the kill"

    model = tmp_path / "resumed.keras"
    resumed = succeeded(launch(launcher, 2, *LONG_RUN, "--checkpoint-dir", checkpoints, "--resume", "--save-model", model))
    resumed_from = int(next(line for line in output_lines(resumed.stdout) if line.startswith("Resuming from")).rsplit("-", 1)[1])
    assert resumed_from >= last_logged - 50 - 10  # at most one checkpoint interval (and one log interval) lost
    assert_same_weights(uninterrupted, saved_weights(model))


RULE = "-" * 74
KILLED_NODE = f"""[node1:10801] Warning: could not find environment variable "OMPI_MCA_mpi_yield_when_idle"
step 30/2000  loss 0.5
Connection to node2 closed by remote host.
{RULE}
ORTE was unable to reliably start one or more daemons.
{RULE}
{RULE}
An MPI communication peer process has unexpectedly disconnected.
  Local host: node1
  Peer host:  node2
{RULE}
hvd_sgd: SIGTERM received: stopping after the next check of the ranks
[node1:10801] 1 more process has sent help message help-mpi-btl-tcp.txt / peer hung up
"""
CUT_OFF_NODE = f"""[1,0]<stdout>:step 20/32000  loss 1.08
{RULE}
ORTE has lost communication with a remote daemon.

  HNP daemon   : [[25104,0],0] on node node1
  Remote daemon: [[25104,0],1] on node node2
{RULE}
[1,0]<stdout>:hvd_sgd: SIGTERM received: stopping after the next check of the ranks
"""
NO_LOSS = f"""{RULE}
mpirun noticed that process rank 1 with PID 0 on node node1 exited on signal 9 (Killed).
{RULE}
[1,0]<stderr>:{RULE}
[1,0]<stderr>:  Peer host:  node1
"""


@pytest.mark.parametrize("launcher_stderr, passed", [
    (KILLED_NODE, [0, 1, 11]),  # the lines before the loss, and the ranks' own after it
    (CUT_OFF_NODE, [0, 7]),
    (NO_LOSS, [0, 1, 2, 3, 4])],  # a banner with no loss in it passes whole; one never closed, at the end
    ids=["killed", "cut_off", "no_loss"])
def test_a_lost_node_is_one_line_and_open_mpis_banners_after_it_are_kept_in_a_file(launcher_stderr, passed):
    """The installation's mpirun relays the launcher's stderr as the recorded texts (Open MPI 4.1.4,
    the killed and cut-off cases of test_multinode.py); everything it holds back is in the file."""
    written = []
    report = mpirun.LostNodeReport(written.append)
    lines = launcher_stderr.encode().splitlines(keepends=True)
    for line in lines:
        report.feed(line)
    report.close()
    said = [line.decode() for line in written]
    naming = [line for line in said if "node2" in line]
    if launcher_stderr is NO_LOSS:
        assert said == [lines[i].decode() for i in passed] and report.kept is None
        return
    assert len(naming) == 1 and naming[0].startswith("hvd_sgd: error: node node2 lost"), said
    assert [line for line in said if line is not naming[0]] == [lines[i].decode() for i in passed], said
    kept = Path(naming[0].rsplit(" ", 1)[1].strip()).read_bytes().splitlines(keepends=True)
    assert sorted(kept + [lines[i] for i in passed]) == sorted(lines)  # nothing lost
    os.remove(report.kept.name)


@pytest.mark.slow
def test_stalled_rank_ends_the_job_naming_it(tmp_path):
    checkpoints, stall_timeout = tmp_path / "ckpt", 20  # start-up under load can take 10 s: not a stall
    run = start_and_wait_for("mpirun", [*LONG_RUN, "--max-steps", 100000, "--stall-timeout", stall_timeout,
                                        "--checkpoint-dir", checkpoints],
                             checkpoint_from_step(checkpoints, 100))
    rank_process(psutil.Process(run.pid), 1).send_signal(signal.SIGSTOP)
    assert_ends_naming(run, 1, time.monotonic(), stall_timeout, waiting_in="_steps")


@pytest.mark.slow
def test_a_suspended_job_goes_on_when_resumed(tmp_path):
    """Slurm's scontrol suspend (or gang scheduling) stops every process of a job, for longer than
    --stall-timeout too: on resume, each rank's watchdog sees that it was stopped itself, not that
    another rank froze, and Horovod's own stall check (off) does not end the job either."""
    checkpoints, stall_timeout = tmp_path / "ckpt", 10  # start-up under load can take 10 s: not a stall
    run = start_and_wait_for("mpirun", [*LONG_RUN, "--stall-timeout", stall_timeout, "--checkpoint-dir", checkpoints],
                             checkpoint_from_step(checkpoints, 100))
    launcher = psutil.Process(run.pid)
    job = [launcher, rank_process(launcher, 0), rank_process(launcher, 1)]  # mpirun puts each rank in its own group
    for process in job:
        frozen(process)
    assert not checkpoint_from_step(checkpoints, LONG_STEPS)(), "the run finished before the suspension"
    time.sleep(stall_timeout + 4)
    for process in job:
        process.send_signal(signal.SIGCONT)
    status, stdout, stderr = ended_within(run, 60)
    assert status == 0 and "Test accuracy" in stdout, stderr[-3000:]


SLOW_EVALUATION = """
import os, time
import tensorflow as tf


def _slow(batch):
    with open(os.environ["EVALUATED"], "a") as f:  # one line a test batch
        f.write("batch\\n")
    time.sleep(3)
    return batch


class SlowWhenTesting(tf.keras.layers.Layer):
    def call(self, x, training=None):
        if training:
            return x
        y = tf.py_function(_slow, [x], x.dtype)
        y.set_shape(x.shape)
        return y


def model(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(), SlowWhenTesting(),
                                tf.keras.layers.Dense(num_classes)])
"""


@pytest.mark.slow
def test_evaluating_longer_than_the_stall_timeout_is_no_stall_but_freezing_then_is(tmp_path):
    """Each rank evaluates its half of the test set, 15 s of test batches at --stall-timeout 10:
    progress (before, both hvd_sgd's watchdog and Horovod's stall check ended the job), but rank 0
    frozen in its next evaluation, the other waiting for it in the all-reduce, ends the job, naming it."""
    (tmp_path / "slow_evaluation.py").write_text(SLOW_EVALUATION)
    evaluated, stall_timeout = tmp_path / "evaluated", 10
    batches = lambda: len(evaluated.read_text().splitlines()) if evaluated.exists() else 0
    run = start_and_wait(launchers.command("mpirun", 2, "hvd_sgd.train", [
        "--model", "slow_evaluation:model", "--train-examples", 2000, "--test-examples", 10000, "--epochs", 2,
        "--stall-timeout", stall_timeout]), lambda: batches() > 10, timeout=180,  # 5 batches a rank each time
        env=launchers.environment(PYTHONPATH=str(tmp_path), EVALUATED=str(evaluated)))
    frozen(rank_process(psutil.Process(run.pid), 0))  # in its second evaluation: the first one passed
    assert_ends_naming(run, 0, time.monotonic(), stall_timeout, waiting_in="evaluate")


SLOW_TRACE = """
import os, time
import horovod.tensorflow as hvd
import tensorflow as tf


class SlowToTrace(tf.keras.layers.Layer):
    \"\"\"On rank 0, sleeps $TRACE_SECONDS in Python each time a step's or an evaluation's graph is
    traced (never while it runs), after a line in the file $TRACING-0: a large model's trace, or an
    XLA compile. (Keras builds the model with training None.)\"\"\"
    def call(self, x, training=None):
        if training is not None and not tf.executing_eagerly() and hvd.rank() == 0:
            with open(f"{os.environ['TRACING']}-0", "a") as f:
                f.write("traced\\n")
            time.sleep(float(os.environ["TRACE_SECONDS"]))
        return x


def model(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.Input(input_shape), SlowToTrace(), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(num_classes)])
"""


def slow_trace_run(tmp_path, trace_seconds, *args):
    """A 2-rank run of the slow-to-trace model under mpirun; its environment."""
    (tmp_path / "slow_trace.py").write_text(SLOW_TRACE)
    env = launchers.environment(PYTHONPATH=str(tmp_path), TRACING=str(tmp_path / "tracing"),
                                TRACE_SECONDS=str(trace_seconds))
    command = launchers.command("mpirun", 2, "hvd_sgd.train", [
        "--model", "slow_trace:model", "--train-examples", 512, "--test-examples", 64, "--max-steps", 12, *args])
    return command, env


@pytest.mark.slow
def test_graphs_that_trace_longer_than_the_stall_timeout_are_no_stall(tmp_path):
    """Rank 0 takes 8 s to trace each of the step's two graphs (plain and sampled) and the
    evaluation's, at --stall-timeout 5: a graph's first call is no stall, nor is rank 1's wait for
    it, in the step's first all-reduce or after its own evaluation (before, the watchdog ended such
    a job after 5 s)."""
    command, env = slow_trace_run(tmp_path, 8, "--stall-timeout", 5)
    succeeded(subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240))
    assert len((tmp_path / "tracing-0").read_text().splitlines()) >= 3


@pytest.mark.slow
def test_a_rank_frozen_during_its_trace_ends_the_job_within_the_stall_timeout(tmp_path):
    """Rank 0 SIGSTOPped while it traces (a 60 s trace, --trace-timeout 120) ends the job after
    --stall-timeout, not after the trace's bound, with the one line naming it."""
    stall_timeout = 10  # start-up under load can take 10 s: not a stall
    command, env = slow_trace_run(tmp_path, 60, "--stall-timeout", stall_timeout, "--trace-timeout", 120)
    run = start_and_wait(command, lambda: (tmp_path / "tracing-0").exists(), timeout=180, env=env)
    rank_process(psutil.Process(run.pid), 0).send_signal(signal.SIGSTOP)
    assert_ends_naming(run, 0, time.monotonic(), stall_timeout, waiting_in="_steps")


class SlowFileSystem:
    """An ext4 file system on a loop device, mounted ``sync``, whose reads and writes from the
    processes in an io cgroup go at the rates ``throttle`` sets: a slow shared file system.
    ``freeze()`` hangs its writes."""

    def __init__(self, tmp_path):
        if not os.path.exists("/dev/loop-control"):
            pytest.skip("a throttled file system needs loop devices")
        self.cgroup = Cgroup("io")
        self.image, self.path = tmp_path / "fs.img", tmp_path / "slow"
        self.path.mkdir()
        with open(self.image, "wb") as f:
            f.truncate(256 << 20)
        subprocess.run(["mkfs.ext4", "-q", self.image], check=True)
        self.device = subprocess.run(["losetup", "--find", "--show", self.image], check=True, capture_output=True,
                                     text=True).stdout.strip()
        subprocess.run(["mount", "-o", "sync", self.device, self.path], check=True)

    def throttle(self, read=0, write=0):
        """Bytes a second (0: no limit)."""
        self.cgroup.throttle(self.device, read, write)

    def remount(self):
        """Empty its page cache, then read its directories and inodes again (outside the cgroup):
        what the processes in the cgroup read next comes from the device, file data alone."""
        subprocess.run(["umount", self.path], check=True)
        subprocess.run(["mount", "-o", "sync", self.device, self.path], check=True)
        for root, _, names in os.walk(self.path):
            for name in names:
                os.stat(os.path.join(root, name))

    def command(self, command):
        """``command``, run in the throttled cgroup (its children too)."""
        return self.cgroup.command(command)

    def freeze(self):
        subprocess.run(["fsfreeze", "--freeze", self.path], check=True)

    def thaw(self):
        subprocess.run(["fsfreeze", "--unfreeze", self.path], capture_output=True)  # fails if not frozen

    def remove(self):
        self.thaw()
        self.throttle()  # what waits in the throttle goes through
        self.cgroup.remove()
        subprocess.run(["umount", "--lazy", self.path], check=True)
        subprocess.run(["losetup", "--detach", self.device], check=True)


@pytest.fixture
def slow_file_system(tmp_path):
    fs = SlowFileSystem(tmp_path)
    yield fs
    fs.remove()


WIDE_MODEL = """
import tensorflow as tf


def model(input_shape, num_classes):  # 3.2 M weights: 25 MB a checkpoint with their momentum
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(), tf.keras.layers.Dense(4000),
                                tf.keras.layers.Dense(num_classes)])
"""


def assert_ends_naming_stuck(status, stderr, ranks, path):
    """The job failed with one line naming ``ranks`` (on this host) stuck in ``path``."""
    lines = [line for line in output_lines(stderr) if "hvd_sgd" in line]
    assert status != 0 and len(lines) == 1, stderr[-3000:]
    stuck = ", ".join(f"{rank} ({os.uname().nodename})" for rank in ranks)
    assert f"rank(s) {stuck} stuck in {path} (a hung file system?)" in lines[0]


def reads_slow_then_hung(slow_file_system, run):
    """``run(timeout)`` with the file system's page cache emptied: it must succeed with reads at
    3 MB/s; returned, what it does with reads hung."""
    slow_file_system.remount()
    slow_file_system.throttle(read=3 << 20)
    slow = succeeded(run(120))
    slow_file_system.remount()
    slow_file_system.throttle(read=1)  # a page in an hour
    return slow, run(60)


def wide_run(checkpoints):
    return ["--model", "wide:model", "--train-examples", 8192, "--test-examples", 100, "--stall-timeout", 5,
            "--checkpoint-dir", checkpoints]


@pytest.mark.slow
def test_a_checkpoint_written_slower_than_the_stall_timeout_is_no_stall_but_a_hung_write_is(slow_file_system, tmp_path):
    """Rank 0 writes checkpoints alone while the others wait for it: 25 MB at 3 MB/s, 8 s, at
    --stall-timeout 5 is progress, since the files grow (TensorFlow writes 8 MB at a time; before,
    the watchdog ended the job), but a write into a frozen file system ends the job, naming it."""
    (tmp_path / "wide.py").write_text(WIDE_MODEL)
    checkpoints = slow_file_system.path / "ckpt"
    slow_file_system.throttle(write=3 << 20)
    run = start_and_wait(slow_file_system.command(launchers.command("mpirun", 2, "hvd_sgd.train", [
        *wide_run(checkpoints), "--max-steps", 100000, "--checkpoint-every-steps", 20])),
        checkpoint_from_step(checkpoints, 20), timeout=180, env=launchers.environment(PYTHONPATH=str(tmp_path)))
    slow_file_system.freeze()
    rank_1 = rank_process(psutil.Process(run.pid), 1)
    # Rank 0 blocks in the frozen file system and cannot exit until it thaws: thaw once rank 1 has gone.
    psutil.wait_procs([rank_1], timeout=60)
    slow_file_system.thaw()
    status, stdout, stderr = ended_within(run, 60)
    assert_ends_naming_stuck(status, stderr, [0], checkpoints)


@pytest.mark.slow
def test_a_checkpoint_read_slower_than_the_stall_timeout_is_no_stall_but_a_hung_read_is(slow_file_system, tmp_path):
    """--resume: rank 0 reads the checkpoint alone while the others wait for it. 25 MB at 3 MB/s at
    --stall-timeout 5 is progress (before, the watchdog ended the job); reads that hang end it."""
    (tmp_path / "wide.py").write_text(WIDE_MODEL)
    checkpoints, env = slow_file_system.path / "ckpt", launchers.environment(PYTHONPATH=str(tmp_path))

    command = slow_file_system.command(launchers.command("mpirun", 2, "hvd_sgd.train", [
        *wide_run(checkpoints), "--max-steps", 21, "--resume"]))

    def resume(timeout):
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    succeeded(launch("mpirun", 2, *wide_run(checkpoints), "--max-steps", 20, env=dict(PYTHONPATH=str(tmp_path))))
    resumed, hung = reads_slow_then_hung(slow_file_system, resume)
    assert f"Resuming from {checkpoints}/ckpt-20" in output_lines(resumed.stdout)
    assert_ends_naming_stuck(hung.returncode, hung.stderr, [0], checkpoints)


@pytest.mark.slow
def test_data_read_slower_than_the_stall_timeout_is_no_stall_but_a_hung_read_is(slow_file_system):
    """The node's first rank reads --data-dir while the others wait for it: 24 MB at 3 MB/s at
    --stall-timeout 5 is progress; reads that hang end the job, naming the ranks and the file
    (before, such a job hung for ever: no watchdog ran yet, and Horovod's own stall check is off)."""
    data = slow_file_system.path / "data.npz"
    np.savez(data, **random_arrays(30000, 100, (28, 28)))
    command = slow_file_system.command(launchers.command("mpirun", 2, "hvd_sgd.train", [
        "--data-dir", data, "--model", "softmax", "--max-steps", 5, "--stall-timeout", 5]))

    def train(timeout):
        return subprocess.run(command, cwd=ROOT, env=launchers.environment(), capture_output=True, text=True,
                              timeout=timeout)

    _, hung = reads_slow_then_hung(slow_file_system, train)
    assert_ends_naming_stuck(hung.returncode, hung.stderr, [0, 1], data)


def test_the_default_stall_timeout_is_the_timer_the_frozen_rank_tests_run(tmp_path):
    """The frozen-rank tests run with --stall-timeout 5 to 20 s to keep CI short; the default, 60 s,
    reaches the same timer: a rank idle for 59.9 s is no stall, for 60.1 s it is (one rank, beating)."""
    from types import SimpleNamespace
    from hvd_sgd import config
    timeout = config.TrainConfig().ranks.stall_timeout
    timer = watchdog.Watchdog(SimpleNamespace(rank=0, size=1), timeout)
    timer.directory = str(tmp_path)  # where start() would put the job's heartbeats
    timer.progress(step=7)
    timer._beat()
    assert timeout == 60 and not timer.stalled(timer.last_progress + 59.9) and timer.stalled(timer.last_progress + 60.1)


def test_a_graphs_first_call_is_no_stall_until_the_trace_timeout(tmp_path):
    """At the defaults: idle for 60.1 s in a graph's first call is no stall; in one for 600.1 s it is."""
    from types import SimpleNamespace
    from hvd_sgd import config
    ranks = config.TrainConfig().ranks
    timer = watchdog.Watchdog(SimpleNamespace(rank=0, size=1), ranks.stall_timeout, ranks.trace_timeout)
    timer.directory = str(tmp_path)
    with timer.tracing():
        timer._beat()
        assert not timer.stalled(timer.last_progress + ranks.stall_timeout + 0.1)
        timer.tracing_since -= ranks.trace_timeout + 0.1  # its beat says how long it has traced
        timer._beat()
        assert ranks.trace_timeout == 600 and timer.stalled(timer.last_progress + ranks.stall_timeout + 0.1)


def test_heartbeat_directories_left_by_killed_jobs_are_swept(tmp_path):
    """A killed rank never runs its atexit; the next job's rank 0 removes what has not changed for
    a day, and nothing else (a live job's directory changes every second)."""
    dead, live, other = (tmp_path / name for name in ("hvd_sgd-heartbeat-dead", "hvd_sgd-heartbeat-live", "other"))
    for directory in (dead, live, other):
        directory.mkdir()
        (directory / "rank-0").write_text("5 host")
    day_old = time.time() - watchdog.STALE_SECONDS - 60
    for directory in (dead, other):
        os.utime(directory, (day_old, day_old))
    watchdog.remove_stale_heartbeats(str(tmp_path))
    assert not dead.exists() and live.exists() and other.exists()


# --- checkpoints -----------------------------------------------------------------------------

@pytest.mark.both_stacks
def test_a_checkpoint_restores_batch_normalizations_moving_statistics(tmp_path):
    """Keras 3 puts the trainable variables in a checkpoint through the optimizer; the moving
    statistics, which no optimizer holds, must come through the model."""
    import tensorflow as tf
    from hvd_sgd.training import checkpoint

    def trained_state(mean, variance):
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.BatchNormalization()])
        optimizer = tf.keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        model.layers[0].moving_mean.assign(mean)
        model.layers[0].moving_variance.assign(variance)
        return dict(model=model, optimizer=optimizer, step=tf.Variable(5, dtype=tf.int64))

    saved = checkpoint.Checkpoints(str(tmp_path / "a"), False, print, 64, **trained_state([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]))
    saved.save(5)
    # a copy, to restore from: the first directory's lock is this process's for its life
    shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns(checkpoint.LOCK_FILE))
    fresh = trained_state([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    checkpoint.Checkpoints(str(tmp_path / "b"), True, print, 64, **fresh).restore_latest()
    restored = fresh["model"].layers[0]
    assert restored.moving_mean.numpy().tolist() == [1.0, 2.0, 3.0]
    assert restored.moving_variance.numpy().tolist() == [4.0, 5.0, 6.0]


# --- damaged checkpoints, divergence ----------------------------------------------------------

@pytest.mark.slow
def test_damaged_latest_checkpoint_is_reported_and_the_previous_one_used(tmp_path):
    common = ["--model", "mlp", "--train-examples", 2560, "--test-examples", 500, "--batch-size", 32,
              "--checkpoint-every-steps", 20]  # 40 steps per epoch: checkpoints at 20, 40, 60
    straight = tmp_path / "straight.keras"
    succeeded(launch("mpirun", 2, *common, "--max-steps", 60, "--save-model", straight))
    checkpoints = tmp_path / "ckpt"
    succeeded(launch("mpirun", 2, *common, "--max-steps", 40, "--checkpoint-dir", checkpoints))
    data_file = checkpoints / "ckpt-40.data-00000-of-00001"
    with open(data_file, "r+b") as f:  # a crash in the middle of writing it
        f.truncate(data_file.stat().st_size // 2)
    (checkpoints / "ckpt-41_temp").mkdir()  # what an interrupted save leaves behind
    resumed = tmp_path / "resumed.keras"
    result = succeeded(launch("mpirun", 2, *common, "--max-steps", 60, "--checkpoint-dir", checkpoints, "--resume",
                              "--save-model", resumed))
    lines = output_lines(result.stdout)
    assert sum("Skipping damaged checkpoint" in line and "ckpt-40" in line for line in lines) == 1
    assert any(line.startswith("Resuming from") and line.endswith("ckpt-20") for line in lines)
    assert_same_weights(saved_weights(straight), saved_weights(resumed))


@pytest.mark.slow
def test_a_finished_run_resumed_again_reports_its_result_and_trains_no_more(tmp_path):
    """A job script that always passes --resume, run again once its run has finished: when the
    last step ended an epoch (as --epochs does), it crashed with a traceback."""
    run = ["--model", "softmax", "--train-examples", 1024, "--test-examples", 500, "--epochs", 1,
           "--checkpoint-dir", tmp_path / "ckpt"]
    finished = succeeded(launch("mpirun", 2, *run))
    again = succeeded(launch("mpirun", 2, *run, "--resume"))
    assert reported_accuracy(again) == reported_accuracy(finished)
    assert not any(line.startswith("step ") for line in output_lines(again.stdout))


@pytest.mark.slow
def test_divergence_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    import tensorflow as tf
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    result = launch("mpirun", 2, "--model", "mlp", "--lr", "1e6", "--train-examples", 4096, "--test-examples", 500,
                    "--checkpoint-dir", checkpoints, "--checkpoint-every-steps", 1, "--log-every-steps", 1,
                    "--metrics-file", metrics)
    assert result.returncode != 0
    errors = error_lines(result)
    assert len(errors) == 1 and "training diverged" in errors[0], result.stderr[-2000:]
    assert not metrics.exists()
    for path in tf.train.get_checkpoint_state(str(checkpoints)).all_model_checkpoint_paths:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            value = reader.get_tensor(name)
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                assert np.isfinite(value).all(), f"{path}: {name} is not finite"


DIVERGING_MODEL = """
import horovod.tensorflow as hvd
import tensorflow as tf


class RankCounter(tf.keras.layers.Layer):
    \"\"\"Adds its rank + 1 to a counter at every training batch: a variable that no all-reduce touches
    (integer, so not averaged as batch normalization's statistics are), which forks the ranks.\"\"\"
    def build(self, input_shape):
        self.count = self.add_weight(name="count", shape=(), dtype="int64", initializer="zeros", trainable=False)

    def call(self, x, training=False):
        if training:
            self.count.assign_add(hvd.rank() + 1)
        return x


def model(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.Input(input_shape), RankCounter(), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(num_classes)])
"""


@pytest.mark.slow
def test_ranks_whose_weights_fork_end_the_job_with_one_line_naming_the_checksums(tmp_path):
    """The check that every summary's weight_checksums rests on: ranks that end with different
    variables (a layer counts by rank) fail the job, with rank 0's one line and no summary."""
    (tmp_path / "diverging.py").write_text(DIVERGING_MODEL)
    metrics = tmp_path / "m.json"
    result = launch("mpirun", 2, "--model", "diverging:model", "--train-examples", 256, "--test-examples", 64,
                    "--max-steps", 3, "--metrics-file", metrics, env=dict(PYTHONPATH=str(tmp_path)))
    errors = error_lines(result)
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-2000:]
    assert re.search(r"ranks hold different weights at the end \(checksums \[(\d+), (?!\1\])\d+\]\)", errors[0]), errors
    assert "Traceback" not in result.stderr and not metrics.exists()


def test_the_identity_check_names_differing_checksums_and_passes_equal_ones():
    from hvd_sgd import JobError
    from hvd_sgd.runtime import world
    assert world.require_identical([7, 7, 7], "at the end") == [7, 7, 7]
    with pytest.raises(JobError, match=re.escape("ranks hold different weights at the end (checksums [7, 8, 7])")):
        world.require_identical([7, 8, 7], "at the end")


# --- elastic ------------------------------------------------------------------------------------

ELASTIC_RUN = ["--model", "mlp", "--train-examples", 8192, "--test-examples", 1000, "--batch-size", 32,
               "--epochs", 4, "--threads-per-rank", 1, "--log-every-steps", 20, "--checkpoint-every-steps", 20]


@pytest.mark.slow
def test_elastic_training_survives_a_lost_worker_and_keeps_its_epochs(tmp_path):
    """3 workers on three names of this machine (run/discover-hosts); one is killed mid-run.

    An epoch stays the 85 steps it was on 3 workers (8192 // 96): epoch ends, the schedule (cosine
    to 0 at 4 epochs), the logs and the metrics file all count those steps after the job shrinks."""
    normal = tmp_path / "normal.json"
    succeeded(launch("mpirun", 3, *ELASTIC_RUN, "--metrics-file", normal))
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "elastic.json"
    command = [launchers.venv_bin("horovodrun"), "-np", "3", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", ROOT / "run" / "discover-hosts",
               PYTHON, "-m", "hvd_sgd.train", "--elastic", *ELASTIC_RUN,
               "--checkpoint-dir", checkpoints, "--metrics-file", metrics]
    run = start_and_wait(command, checkpoint_from_step(checkpoints, 60), timeout=120)
    rank_process(psutil.Process(run.pid), 2).send_signal(signal.SIGKILL)
    status, stdout, stderr = ended_within(run, 240)
    assert status == 0, stderr[-3000:]
    lines = output_lines(stdout)
    restart = next(line for line in lines if "elastic (re)start" in line and "with 2 rank(s)" in line)
    assert int(restart.split("at step ")[1].split()[0]) >= 60 - 10  # at most one commit interval lost
    summary, reference = read_json(metrics), read_json(normal)
    assert summary["world_size"] == 2 and summary["steps"] == reference["steps"] == 4 * 85
    assert summary["steps_per_epoch"] == 85 and summary["epochs"] == 4.0
    assert abs(summary["test_accuracy"] - reference["test_accuracy"]) < 0.02, (summary["test_accuracy"], reference["test_accuracy"])
    evaluated = {float(line.split()[1].rstrip(":")) for line in lines if line.startswith("epoch ")}
    assert evaluated == {1.0, 2.0, 3.0, 4.0}, evaluated
    for line in lines:
        if line.startswith("step "):
            step, epoch = int(line.split()[1].split("/")[0]), float(line.split()[3])
            assert epoch == pytest.approx(step / 85, abs=0.005), line
    last = next(line for line in reversed(lines) if line.startswith("step 340/340"))
    assert float(last.split("lr ")[1].split()[0]) == pytest.approx(0, abs=1e-6), last


@pytest.mark.slow
def test_elastic_training_on_one_host_of_two_slots_trains(tmp_path):
    """The obvious discovery script on one machine, `echo localhost:2`: before the launcher patch,
    horovodrun waited for a second host to find the hosts' common network interfaces, silently,
    for its elastic timeout (10 minutes)."""
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    metrics = tmp_path / "m.json"
    result = succeeded(subprocess.run(list(map(str, [
        launchers.venv_bin("horovodrun"), "-np", 2, "--min-np", 1, "--max-np", 2, "--host-discovery-script", discover,
        PYTHON, "-m", "hvd_sgd.train", "--elastic", "--model", "softmax", "--max-steps", 20, "--train-examples", 2048,
        "--test-examples", 500, "--metrics-file", metrics])), cwd=ROOT, env=launchers.environment(), capture_output=True,
        text=True, timeout=120))
    assert read_json(metrics)["world_size"] == 2 and "Test accuracy" in result.stdout


# --- one run per checkpoint directory -------------------------------------------------------------

def snapshot(directory):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


@pytest.mark.slow
def test_a_second_run_on_a_checkpoint_directory_in_use_fails_in_one_line(tmp_path):
    """The first run (stopped mid-way, so that it holds the directory while the others try) is
    unaffected: it ends with only its own checkpoints, the last one holding its final weights."""
    import tensorflow as tf
    checkpoints, model = tmp_path / "ckpt", tmp_path / "first.keras"
    first = start_and_wait(launchers.command("python", 1, "hvd_sgd.train", [
        *LONG_RUN, "--max-steps", 400, "--stall-timeout", 600, "--checkpoint-dir", checkpoints, "--save-model", model]),
        checkpoint_from_step(checkpoints, 50), timeout=120)
    frozen(psutil.Process(first.pid))
    try:
        before = snapshot(checkpoints)
        for launcher, np_, resume in (("python", 1, []), ("mpirun", 2, ["--resume"]), ("horovodrun", 2, [])):
            second = launch(launcher, np_, *LONG_RUN, "--seed", 2, "--checkpoint-dir", checkpoints, *resume, timeout=120)
            assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr[-2000:]
            [line] = error_lines(second)
            assert f"--checkpoint-dir {checkpoints} is in use by another run" in line and f"pid {first.pid}," in line, line
            assert snapshot(checkpoints) == before, launcher  # nothing in the directory changed
    finally:
        first.send_signal(signal.SIGCONT)
    status, stdout, stderr = ended_within(first, 120)
    assert status == 0, stderr[-3000:]
    state = tf.train.get_checkpoint_state(str(checkpoints))
    every_50_steps_and_epoch_end = sorted({*range(50, 401, 50), *range(64, 401, 64)})  # 16384 // 256 = 64 steps an epoch
    assert [int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths] == every_50_steps_and_epoch_end[-3:]
    reader = tf.train.load_checkpoint(state.model_checkpoint_path)
    # The first layer's kernel: the model's under Keras 2; under Keras 3, whose models tf.train does
    # not walk, the first of the variables the optimizer updates.
    kernel = next(name for name in reader.get_variable_to_shape_map()
                  if name.startswith(("model/layer_with_weights-0/kernel", "optimizer/_trainable_variables/0/"))
                  and "OPTIMIZER" not in name)
    np.testing.assert_array_equal(reader.get_tensor(kernel), saved_weights(model)[0])


@pytest.mark.slow
def test_a_killed_runs_lock_goes_with_it(tmp_path):
    checkpoints = tmp_path / "ckpt"
    run = start_and_wait(launchers.command("python", 1, "hvd_sgd.train", [*LONG_RUN, "--checkpoint-dir", checkpoints]),
                         checkpoint_from_step(checkpoints, 50), timeout=120)
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=30)
    resumed = succeeded(launch("python", 1, *LONG_RUN, "--max-steps", 100, "--checkpoint-dir", checkpoints, "--resume"))
    assert any(line.startswith("Resuming from") for line in output_lines(resumed.stdout))


@pytest.mark.slow
def test_the_tf1_program_refuses_a_checkpoint_directory_in_use(tmp_path):
    checkpoints = tmp_path / "ckpt"
    holder = subprocess.Popen([PYTHON, "-c", "import sys, time; from hvd_sgd.training import checkpoint; "
                               "checkpoint.lock_directory(sys.argv[1], 'test'); print('locked', flush=True); time.sleep(300)",
                               str(checkpoints)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = launch("mpirun", 2, "--steps", 10, "--checkpoint-dir", checkpoints, module="hvd_sgd.train_v1", timeout=120)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        [line] = error_lines(result, "hvd_sgd.train_v1")
        assert f"is in use by another run (host {os.uname().nodename}, pid {holder.pid}," in line, line
    finally:
        holder.kill()
        holder.wait()
