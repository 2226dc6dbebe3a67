"""Faults and bad input: real processes killed and stopped, damaged files, diverging runs.

Each bad input must give one line naming the problem, from one rank; a non-zero exit on every
rank; no hang; and no output left behind that looks valid."""
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import PYTHON, ROOT, launch, launch_command, output_lines, read_json, saved_weights, succeeded
from test_data import write_dataset, write_idx


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


BAD_INPUT = {
    "missing data directory": (lambda t: ["--data-dir", t / "nowhere"], "no such directory"),
    "truncated IDX file": (lambda t: idx_dir(t, lambda d: write_idx(d / IMAGES, np.zeros((256, 4, 4)), cut=100)), "truncated"),
    "wrong IDX magic": (lambda t: idx_dir(t, lambda d: write_idx(d / IMAGES, np.zeros((256, 4, 4)), magic=b"PK\3\4")), "bad magic number"),
    "image/label count mismatch": (lambda t: idx_dir(t, lambda d: write_idx(d / LABELS, np.zeros(255))), "256 images but 255 labels"),
    "label out of range": (lambda t: idx_dir(t, lambda d: write_idx(d / LABELS, np.full(256, 12))), "label 12 is out of range"),
    "batch size 0": (lambda t: ["--batch-size", 0], "--batch-size must be at least 1"),
    "negative batch size": (lambda t: ["--batch-size", -4], "--batch-size must be at least 1"),
    "batch larger than a shard": (lambda t: ["--train-examples", 256, "--batch-size", 200], "larger than a rank's shard"),
    "more ranks than examples": (lambda t: ["--train-examples", 1], "2 ranks but only 1 training examples"),
    "unknown model": (lambda t: ["--model", "resnet50"], "invalid choice: 'resnet50'"),
    "unknown dataset": (lambda t: ["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
    "epochs 0": (lambda t: ["--epochs", 0], "--epochs must be at least 1"),
    "negative learning rate": (lambda t: ["--lr", -0.1], "--lr must be a positive number"),
    "resume with another model's checkpoint": (checkpoint_of_another_model, "does not fit this model"),
    "resume with no checkpoint": (lambda t: ["--checkpoint-dir", t / "empty", "--resume"], "no readable checkpoint"),
    "checkpoint index pointing outside the directory": (checkpoint_index_pointing_outside, "no readable checkpoint"),
    "checkpoints there but no --resume": (existing_checkpoints_without_resume, "already holds checkpoints"),
    "checkpoint dir not writable": (lambda t: ["--checkpoint-dir", "/proc/hvd_sgd"], "rank 0: --checkpoint-dir /proc/hvd_sgd is not writable"),
    "model path not writable": (lambda t: ["--save-model", "/proc/hvd_sgd/m.keras"], "rank 0: /proc/hvd_sgd/m.keras: cannot create"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input(case, tmp_path):
    make_args, message = BAD_INPUT[case]
    args = make_args(tmp_path)
    outputs = {"--metrics-file": tmp_path / "out" / "metrics.json", "--save-model": tmp_path / "out" / "model.keras"}
    outputs = {flag: path for flag, path in outputs.items() if flag not in map(str, args)}
    exits = tmp_path / "exits"
    exits.mkdir()
    # mpirun must not kill the other rank when the first fails: each rank's own exit status is checked.
    rank_wrapper = f'"$@"; status=$?; echo $status > {exits}/rank-$OMPI_COMM_WORLD_RANK; exit $status'
    command = ["mpirun", "-np", "2", "--oversubscribe", "--mca", "orte_abort_on_non_zero_status", "0",
               "sh", "-c", rank_wrapper, "sh", PYTHON, "-m", "hvd_sgd.train", "--model", "softmax",
               "--max-steps", 3, *args, *[x for pair in outputs.items() for x in pair]]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    result = subprocess.run(list(map(str, command)), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in output_lines(result.stderr) if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert errors[0].startswith("hvd_sgd.train: error: ")
    assert "Traceback" not in result.stdout + result.stderr
    statuses = sorted(int(p.read_text()) for p in exits.iterdir())
    assert len(statuses) == 2 and all(statuses), statuses
    for path in outputs.values():
        assert not path.exists(), f"{path} was written"


# --- a rank dies, a rank stalls -----------------------------------------------------------------

def rank_process(launcher, rank):
    """The training process of one rank among the launcher's descendants."""
    for child in launcher.children(recursive=True):
        try:
            env = child.environ()
            if child.cmdline()[:1] == [PYTHON] and rank == int(env.get("HOROVOD_RANK", env.get("OMPI_COMM_WORLD_RANK", -1))):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def start_and_wait_for(launcher_name, args, ready, timeout=120):
    """Start a 2-rank run in the background; return it once ``ready()`` is true."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    return start_and_wait(launch_command(launcher_name, 2, "hvd_sgd.train", args), env, ready, timeout)


def start_and_wait(command, env, ready, timeout):
    process = subprocess.Popen(list(map(str, command)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, ("the run ended before it got ready", process.communicate())
        assert time.monotonic() < deadline, "the run never got ready"
        time.sleep(0.2)
    return process


def ended_within(process, seconds):
    try:
        stdout, stderr = process.communicate(timeout=seconds)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {seconds} s")


LONG_STEPS = 2000  # 32 steps an epoch, ~2 ms a step: seconds of run left after the first checkpoints
LONG_RUN = ["--model", "mlp", "--train-examples", 16384, "--test-examples", 500, "--batch-size", 256,
            "--epochs", 100, "--max-steps", LONG_STEPS, "--log-every-steps", 10, "--checkpoint-every-steps", 50]


def checkpoint_from_step(directory, step):
    """Whether a checkpoint of ``step`` or later is there (older ones are rotated away, so wait for any)."""
    return lambda: any(int(index.name[len("ckpt-"):-len(".index")]) >= step for index in directory.glob("ckpt-*.index"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("uninterrupted") / "model.keras"
    succeeded(launch("mpirun", 2, *LONG_RUN, "--save-model", path))
    return saved_weights(path)


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
    last_logged = max(int(line.split()[1].split("/")[0]) for line in output_lines(stdout) if line.startswith("step "))
    assert last_logged < LONG_STEPS, "the run finished before the kill"

    model = tmp_path / "resumed.keras"
    resumed = succeeded(launch(launcher, 2, *LONG_RUN, "--checkpoint-dir", checkpoints, "--resume", "--save-model", model))
    resumed_from = int(next(line for line in output_lines(resumed.stdout) if line.startswith("Resuming from")).rsplit("-", 1)[1])
    assert resumed_from >= last_logged - 50 - 10  # at most one checkpoint interval (and one log interval) lost
    for a, b in zip(uninterrupted, saved_weights(model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_stalled_rank_ends_the_job_naming_it(tmp_path):
    checkpoints = tmp_path / "ckpt"
    run = start_and_wait_for("mpirun", [*LONG_RUN, "--max-steps", 100000, "--stall-timeout", 8,
                                        "--checkpoint-dir", checkpoints],
                             checkpoint_from_step(checkpoints, 100))
    rank_process(psutil.Process(run.pid), 1).send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    status, stdout, stderr = ended_within(run, 60)
    assert status != 0 and time.monotonic() - stopped_at < 8 + 15
    lines = [line for line in output_lines(stderr) if "hvd_sgd" in line]
    assert len(lines) == 1 and "rank(s) 1 stopped responding" in lines[0], stderr[-3000:]


# --- damaged checkpoints, divergence ----------------------------------------------------------

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
    for a, b in zip(saved_weights(straight), saved_weights(resumed), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_divergence_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    import tensorflow as tf
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    result = launch("mpirun", 2, "--model", "mlp", "--lr", "1e6", "--train-examples", 4096, "--test-examples", 500,
                    "--checkpoint-dir", checkpoints, "--checkpoint-every-steps", 1, "--log-every-steps", 1,
                    "--metrics-file", metrics)
    assert result.returncode != 0
    errors = [line for line in output_lines(result.stderr) if "error:" in line]
    assert len(errors) == 1 and "training diverged" in errors[0], result.stderr[-2000:]
    assert not metrics.exists()
    for path in tf.train.get_checkpoint_state(str(checkpoints)).all_model_checkpoint_paths:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            value = reader.get_tensor(name)
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                assert np.isfinite(value).all(), f"{path}: {name} is not finite"


# --- elastic ------------------------------------------------------------------------------------

ELASTIC_RUN = ["--model", "mlp", "--train-examples", 8192, "--test-examples", 1000, "--batch-size", 32,
               "--epochs", 4, "--threads-per-rank", 1, "--log-every-steps", 20, "--checkpoint-every-steps", 20]


def test_elastic_training_survives_a_lost_worker(tmp_path):
    """3 workers on three names of this machine (run/discover-hosts); one is killed mid-run."""
    normal = tmp_path / "normal.json"
    succeeded(launch("mpirun", 3, *ELASTIC_RUN, "--metrics-file", normal))
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "elastic.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [str(Path(PYTHON).parent / "horovodrun"), "-np", "3", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", str(ROOT / "run" / "discover-hosts"),
               PYTHON, "-m", "hvd_sgd.train", "--elastic", *map(str, ELASTIC_RUN),
               "--checkpoint-dir", str(checkpoints), "--metrics-file", str(metrics)]
    run = start_and_wait(command, env, checkpoint_from_step(checkpoints, 60), timeout=120)
    rank_process(psutil.Process(run.pid), 2).send_signal(signal.SIGKILL)
    status, stdout, stderr = ended_within(run, 240)
    assert status == 0, stderr[-3000:]
    lines = output_lines(stdout)
    restart = next(line for line in lines if "elastic (re)start" in line and "with 2 rank(s)" in line)
    assert int(restart.split("at step ")[1].split()[0]) >= 60 - 10  # at most one commit interval lost
    summary, reference = read_json(metrics), read_json(normal)
    assert summary["world_size"] == 2 and summary["steps"] == reference["steps"] == 4 * (8192 // 96)
    assert abs(summary["test_accuracy"] - reference["test_accuracy"]) < 0.02, (summary["test_accuracy"], reference["test_accuracy"])
