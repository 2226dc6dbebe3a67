"""The job script, submitted with sbatch to a real single-node Slurm brought up for these tests."""
import os
import re
import subprocess
import time

import pytest

from conftest import ROOT, assert_same_weights, launch, read_json, saved_weights, succeeded
from test_reliability import LONG_RUN, checkpoint_from_step

pytestmark = pytest.mark.slurm
CLUSTER = ROOT / "run" / "slurm" / "local-cluster"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A private cluster (own state directory and ports), torn down whatever the tests do."""
    env = dict(os.environ, HVD_SGD_SLURM_DIR=str(tmp_path_factory.mktemp("slurm")),
               HVD_SGD_SLURMCTLD_PORT="16917", HVD_SGD_SLURMD_PORT="16918")
    try:
        subprocess.run([CLUSTER, "up"], env=env, check=True, timeout=180)
        env["SLURM_CONF"] = os.path.join(env["HVD_SGD_SLURM_DIR"], "slurm.conf")
        yield env
    finally:
        subprocess.run([CLUSTER, "down"], env=env, timeout=60)


def run_job(env, *sbatch_args, timeout=240):
    """Submit a batch job and wait for it to end; its final state."""
    return wait_for_job(env, submit_job(env, *sbatch_args), timeout)


def submit_job(env, *sbatch_args):
    job = subprocess.run(["sbatch", "--parsable", *map(str, sbatch_args)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    job_id = job.stdout.strip().split(";")[0]
    assert job_id.isdigit(), job.stderr
    return job_id


def job_state(env, job_id):
    info = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return re.search(r"JobState=(\w+)", info).group(1), int(re.search(r"Restarts=(\d+)", info).group(1))


def wait_for_job(env, job_id, timeout=240, hurry_requeued=False):
    """Poll every half second (sbatch --wait polls every 10 s or so) until the job ends; its final
    state. ``hurry_requeued``: start a requeued job after 10 s pending, not the 2 minutes Slurm
    holds it (at once, its new step can collide with the old one's teardown: "aborted before step
    completely launched")."""
    deadline, pending_since = time.monotonic() + timeout, None
    while True:
        state, restarts = job_state(env, job_id)
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED"):
            return state
        if hurry_requeued and state == "PENDING" and restarts:
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since > 10:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env,
                               capture_output=True)
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s"
        time.sleep(0.5)


def submit(slurm, tmp_path, launcher, *args):
    """The real job script on 2 tasks; returns (job state, job output)."""
    output = tmp_path / "job.out"
    state = run_job(dict(slurm, LAUNCHER=launcher), f"--output={output}", "--ntasks-per-node=2",
                    ROOT / "run" / "slurm" / "train.sbatch", *args)
    return state, output.read_text()


@pytest.mark.parametrize("launcher", ["srun", "mpirun", "horovodrun"])
def test_job_script_trains_with_each_launcher(slurm, tmp_path, launcher):
    metrics = tmp_path / "metrics.json"
    state, output = submit(slurm, tmp_path, launcher, "--model", "softmax", "--max-steps", 20, "--train-examples", 2048,
                           "--test-examples", 1000, "--metrics-file", metrics)
    assert state == "COMPLETED", output
    assert re.search(r"Test accuracy: \d\.\d{4}$", output.strip()), output[-2000:]
    assert read_json(metrics)["world_size"] == 2


def test_a_bad_argument_fails_the_job_with_one_line(slurm, tmp_path):
    state, output = submit(slurm, tmp_path, "srun", "--batch-size", 0)
    assert state == "FAILED"
    assert output.count("hvd_sgd.train: error: --batch-size must be at least 1") == 1, output
    assert "Traceback" not in output


def test_a_signalled_job_checkpoints_requeues_itself_and_ends_with_the_weights_of_one_run(slurm, tmp_path):
    """REQUEUE=1; `scancel --signal=USR1 --batch` (what --signal=B:USR1@60 sends before the time
    limit): the job stops at a step with its checkpoint, requeues itself, and the requeued job
    resumes from it with the same command, ending where an uninterrupted run ends."""
    run = [*LONG_RUN, "--max-steps", 3200]
    checkpoints, model, output = tmp_path / "ckpt", tmp_path / "model.keras", tmp_path / "job.out"
    job_id = submit_job(dict(slurm, LAUNCHER="srun", REQUEUE="1"), f"--output={output}", "--open-mode=append",
                        "--ntasks-per-node=2", ROOT / "run" / "slurm" / "train.sbatch", *run,
                        "--checkpoint-dir", checkpoints, "--save-model", model)
    deadline = time.monotonic() + 120
    while not checkpoint_from_step(checkpoints, 100)():
        assert time.monotonic() < deadline and job_state(slurm, job_id)[0] in ("PENDING", "RUNNING"), \
            output.read_text()[-3000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm, check=True)
    assert wait_for_job(slurm, job_id, hurry_requeued=True) == "COMPLETED", output.read_text()[-3000:]
    text = output.read_text()
    stopped_at = int(re.search(r"stopped on SIGUSR1 at step (\d+)/", text).group(1))
    assert stopped_at < 3200 and f"hvd_sgd job {job_id}: requeued" in text and ", restart 1" in text, text[-3000:]
    assert f"Slurm requeued job {job_id} (restart 1): resuming" in text
    assert f"Resuming from {checkpoints}/ckpt-{stopped_at}" in text
    uninterrupted = tmp_path / "uninterrupted.keras"
    succeeded(launch("mpirun", 2, *run, "--threads-per-rank", 1, "--save-model", uninterrupted))
    assert_same_weights(saved_weights(uninterrupted), saved_weights(model))
