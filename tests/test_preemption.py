"""A signal stops the run cleanly: every rank after the same step, rank 0's checkpoint of exactly
that step, one line, exit status 75; a second signal exits at once. The Slurm side (the job
script's signal, requeue and implied resume) is in test_slurm."""
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import (LONG_RUN, ROOT, assert_same_weights, checkpoint_from_step, ended_within, frozen,
                      latest_checkpoint_step, launch, output_lines, rank_process, saved_weights, start_and_wait,
                      succeeded)
from hvd_sgd.bench import launchers
from hvd_sgd.training import checkpoint
from hvd_sgd.runtime.cli import EXIT_STOPPED
from hvd_sgd.runtime.preemption import CHECK_EVERY_SECONDS

pytestmark = pytest.mark.slow


def stop_lines(stderr):
    return [line for line in output_lines(stderr) if "hvd_sgd" in line and "stopped on" in line]


# (launcher, ranks, signal, whom): a signal to the launcher's process alone (a supervisor's, a
# workflow engine's or a user's kill), to a rank, or to the run's process group (a terminal's Ctrl-C).
# The installation's mpirun (which horovodrun and run/train run) turns its signal into SIGUSR1,
# which mpirun forwards to every rank; horovodrun --gloo sends its workers SIGTERM. So each launcher
# is given one signal or two, not all three: the three take one path in the installation's mpirun
# (SIGTERM to it is run/train's case, which execs it).
# A stop takes seconds, and several times longer under the whole suite's load on 2 cores; the bound
# stays below a stop that waited for a timeout instead (Open MPI's keepalive, the watchdog's).
PROMPT_STOP_SECONDS = 20
CASES = [
    ("python", 1, signal.SIGINT, "launcher"),
    ("mpirun", 2, signal.SIGUSR1, "launcher"),
    ("mpirun", 2, signal.SIGTERM, "rank 1"),
    ("horovodrun", 2, signal.SIGTERM, "launcher"),
    ("horovodrun", 2, signal.SIGINT, "process group"),
    ("horovodrun-gloo", 2, signal.SIGTERM, "launcher"),
    ("horovodrun-gloo", 2, signal.SIGUSR1, "launcher"),
    ("run/train", 2, signal.SIGTERM, "launcher"),
]


def command(launcher, np_, args):
    if launcher == "run/train":  # NP ranks under the installation's mpirun, after a set-up check
        return [ROOT / "run" / "train", *args]
    return launchers.command(launcher, np_, "hvd_sgd.train", args)


def left_running(session, processes=(), seconds=5):
    """The processes of the run's session (start_new_session), and of ``processes`` (horovodrun
    starts its ranks in a session of their own), still there after ``seconds``: none, once it has
    ended (a process being reaped, a zombie, is gone)."""
    deadline = time.monotonic() + seconds
    while True:
        left = []
        for process in {*psutil.process_iter(["pid"]), *processes}:
            try:
                if (process in processes or os.getsid(process.pid) == session) and process.is_running() \
                        and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(" ".join(process.cmdline()))
            except (psutil.NoSuchProcess, ProcessLookupError, psutil.AccessDenied):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def unlocked(directory, seconds=5):
    """Whether a new run could take ``directory`` (checkpoint.LOCK_FILE is free) within ``seconds``:
    the launcher may end a moment before rank 0, which holds the lock until it exits."""
    deadline = time.monotonic() + seconds
    with open(directory / checkpoint.LOCK_FILE, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)


@pytest.mark.parametrize("launcher,np_,signum,whom", CASES, ids=[f"{c[0]}-{c[2].name}-{c[3]}" for c in CASES])
def test_a_signal_stops_every_rank_after_the_same_step_with_its_checkpoint(launcher, np_, signum, whom, tmp_path,
                                                                           uninterrupted):
    """Every rank after the same step, its checkpoint, one line, status 75, nothing left running,
    the checkpoint directory free for the next run."""
    checkpoints = tmp_path / "ckpt"
    batch = ["--batch-size", 512] if np_ == 1 else []  # the global batch of 2 ranks x 256
    run = start_and_wait(command(launcher, np_, [*LONG_RUN, *batch, "--max-steps", 100000,
                                                 "--checkpoint-dir", checkpoints]),
                         checkpoint_from_step(checkpoints, 100), timeout=120, env=launchers.environment(NP=str(np_)))
    tree = psutil.Process(run.pid).children(recursive=True)  # the ranks among them
    if whom == "launcher":
        run.send_signal(signum)
    elif whom == "process group":  # the run's own (start_new_session), as a terminal's Ctrl-C reaches it
        os.killpg(run.pid, signum)
    else:
        rank_process(psutil.Process(run.pid), 1).send_signal(signum)
    signalled = time.monotonic()
    status, stdout, stderr = ended_within(run, 60)
    took = time.monotonic() - signalled
    assert took < PROMPT_STOP_SECONDS, f"the stop took {took:.1f} s"
    [line] = stop_lines(stderr)
    stopped_at = int(line.split(" at step ")[1].split("/")[0])
    assert latest_checkpoint_step(checkpoints) == stopped_at, line
    assert f"checkpoint saved in {checkpoints}: the same command with --resume continues" in line
    assert "Traceback" not in stderr, stderr[-3000:]
    if whom == "process group":  # mpirun got the SIGINT too, and ends as it aborts a job: 1
        assert status != 0, stderr[-2000:]
    else:
        assert status == EXIT_STOPPED, (status, stderr[-2000:])
    assert not left_running(run.pid, tree) and unlocked(checkpoints)
    if launcher == "mpirun" and signum == signal.SIGUSR1:  # nothing lost: resumed, it ends where one run ends
        model = tmp_path / "resumed.keras"
        resumed = succeeded(launch("mpirun", 2, *LONG_RUN, "--checkpoint-dir", checkpoints, "--resume",
                                   "--save-model", model))
        assert f"Resuming from {checkpoints}/ckpt-{stopped_at}" in resumed.stdout
        assert_same_weights(uninterrupted, saved_weights(model))


def test_a_second_signal_exits_at_once_without_a_checkpoint(tmp_path):
    """Rank 1 frozen, so the stop cannot finish: a second SIGTERM to rank 0 ends it at once, and
    the latest checkpoint is still a periodic one (every 50 steps, or an epoch's end: 32 on 2 ranks)."""
    checkpoints = tmp_path / "ckpt"
    run = start_and_wait(launchers.command("mpirun", 2, "hvd_sgd.train", [
        *LONG_RUN, "--max-steps", 100000, "--stall-timeout", 600, "--checkpoint-dir", checkpoints]),
        checkpoint_from_step(checkpoints, 100), timeout=120)
    launcher = psutil.Process(run.pid)
    stopped, first = frozen(rank_process(launcher, 1)), rank_process(launcher, 0)
    time.sleep(1)  # rank 0 now waits for rank 1: no step, and no checkpoint, until the signals
    periodic = latest_checkpoint_step(checkpoints)
    try:
        first.send_signal(signal.SIGTERM)
        time.sleep(1.5)  # more than the window in which a signal counts as the same request
        first.send_signal(signal.SIGTERM)
        status, stdout, stderr = ended_within(run, 30)
    finally:
        if stopped.is_running():
            stopped.send_signal(signal.SIGCONT)
    assert status != 0 and "second signal (SIGTERM): exiting without a checkpoint" in stderr, stderr[-3000:]
    assert not stop_lines(stderr)
    assert latest_checkpoint_step(checkpoints) == periodic >= 100  # the stop wrote none


def catches(process, signum):
    """Whether ``process`` has a handler for ``signum`` (SigCgt in /proc: the bit signum - 1)."""
    with open(f"/proc/{process.pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signum - 1) & 1)


def test_a_signal_during_start_up_stops_the_run_at_its_first_check(tmp_path):
    """SIGUSR1 as soon as the process catches it, before Horovod has started and the data has
    loaded: the run still starts, stops at its first check with a checkpoint, and exits 75."""
    checkpoints = tmp_path / "ckpt"
    run = start_and_wait(launchers.command("python", 1, "hvd_sgd.train", [
        *LONG_RUN, "--max-steps", 100000, "--checkpoint-dir", checkpoints]), lambda: True, timeout=0)
    deadline = time.monotonic() + 60
    while not catches(run, signal.SIGUSR1):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.01)
    run.send_signal(signal.SIGUSR1)
    status, stdout, stderr = ended_within(run, 60)
    assert status == EXIT_STOPPED, stderr[-3000:]
    lines = output_lines(stdout)
    received, started = (next(i for i, line in enumerate(lines) if text in line)
                         for text in ("SIGUSR1 received", "rank(s) on"))
    assert received < started, stdout  # the request came before fit began, and was kept
    [line] = stop_lines(stderr)
    stopped_at = int(line.split(" at step ")[1].split("/")[0])
    assert stopped_at == 1 and latest_checkpoint_step(checkpoints) == stopped_at, line  # the first check: after step 1


CHECK_INTERVALS = """
import json
from hvd_sgd.runtime import preemption, startup
startup.start()
import horovod.tensorflow as hvd
stop = preemption.StopRequest(60)
if hvd.rank() == 1:
    stop.signal = "SIGUSR1"  # as a signal to this rank sets it
seconds = [0.0002, 0.001][hvd.rank()]  # rank 1 steps five times slower
agreed = [stop.agreed(s) for s in (seconds, 0.0, 10 * seconds)]
agreed = hvd.allgather_object(agreed)
if hvd.rank() == 0:
    print(json.dumps(agreed))
"""


def test_the_ranks_agree_on_the_request_and_on_when_to_ask_again():
    """Every rank gets the same answer: some rank was signalled, and the next check comes after
    CHECK_EVERY_SECONDS of the slowest rank's steps (after one step while no step was timed)."""
    result = succeeded(subprocess.run([launchers.mpirun(), "-np", "2", sys.executable, "-c", CHECK_INTERVALS],
                                      env=launchers.environment(), cwd=ROOT, capture_output=True, text=True,
                                      timeout=120))
    answers = json.loads(output_lines(result.stdout)[-1])
    every_step = round(CHECK_EVERY_SECONDS / 0.001)
    assert answers[0] == answers[1] == [[True, every_step], [True, 1], [True, max(1, every_step // 10)]], answers
