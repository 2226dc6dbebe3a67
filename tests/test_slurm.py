"""The job script, submitted with sbatch to a real single-node Slurm brought up for these tests."""
import os
import re
import subprocess
import time

import pytest

from conftest import ROOT, read_json

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
    """Submit a batch job and wait for it to end (polled every half second: sbatch --wait polls
    every 10 s or so); its final state."""
    job = subprocess.run(["sbatch", "--parsable", *map(str, sbatch_args)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    job_id = job.stdout.strip().split(";")[0]
    assert job_id.isdigit(), job.stderr
    deadline = time.monotonic() + timeout
    while True:
        info = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\w+)", info).group(1)
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state
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
