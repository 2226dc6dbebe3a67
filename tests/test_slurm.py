"""The job script, submitted with sbatch to a real single-node Slurm brought up for these tests. That it
trains under each launcher is test_multinode.py's, on two Slurm nodes."""
import os
import re
import subprocess

import pytest

from conftest import (LONG_RUN, ROOT, checkpoint_from_step, launch, run_job, submit_job, succeeded,
                      wait_for_job)

# run/test's xdist workers run the cluster tests (this file's and test_multinode's) on one worker, in order.
pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.xdist_group("clusters")]
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


def requeued(times):
    """An ``until`` for wait_for_job: the job is back in the queue after its ``times``-th requeue.
    Restarts counts a requeue while the old run is still COMPLETING (CI saw that state): wait on."""
    return lambda state, restarts: restarts == times and state == "PENDING"


def submit(slurm, tmp_path, launcher, *args):
    """The real job script on 2 tasks; returns (job state, job output)."""
    output = tmp_path / "job.out"
    state = run_job(dict(slurm, LAUNCHER=launcher), f"--output={output}", "--ntasks-per-node=2",
                    ROOT / "run" / "slurm" / "train.sbatch", *args)
    return state, output.read_text()


def test_a_bad_argument_fails_the_job_with_one_line(slurm, tmp_path):
    state, output = submit(slurm, tmp_path, "srun", "--batch-size", 0)
    assert state == "FAILED"
    assert output.count("hvd_sgd.train: error: --batch-size must be at least 1") == 1, output
    assert "Traceback" not in output


def checkpoint_values(directory, step):
    """Every saved variable of ``directory``'s checkpoint of ``step`` (the model's, the optimizer's,
    the step), less the count of saves, which a stop adds to."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(directory / f"ckpt-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith(("save_counter", "_CHECKPOINTABLE_OBJECT_GRAPH"))}


def test_a_job_stopped_by_its_time_limit_and_by_scancel_resumes_each_time_as_one_run(slurm, tmp_path):
    """REQUEUE=1, --time=1 --signal=B:USR1@10. Slurm's warning (it looks at limits every 30 s, so it
    comes 10-40 s before the cut-off) stops the run at a step, with its checkpoint; the job requeues
    itself and the requeued job resumes, with the same command. There `scancel --signal=USR1
    --batch` stops it again. What it saved then is bit for bit what an uninterrupted run saves at
    that step (the schedule spans --epochs: --max-steps only cuts a run short)."""
    run = [*LONG_RUN, "--epochs", 10 ** 4, "--max-steps", 10 ** 6]  # runs until stopped
    checkpoints, output = tmp_path / "ckpt", tmp_path / "job.out"
    job_id = submit_job(dict(slurm, LAUNCHER="srun", REQUEUE="1"), f"--output={output}", "--open-mode=append",
                        "--ntasks-per-node=2", "--time=1", "--signal=B:USR1@10", ROOT / "run" / "slurm" / "train.sbatch",
                        *run, "--checkpoint-dir", checkpoints)
    log = lambda: output.read_text()[-3000:]  # noqa: E731
    assert wait_for_job(slurm, job_id, 150, until=requeued(1)) == "PENDING", log()
    time_limit_stop = int(re.findall(r"stopped on SIGUSR1 at step (\d+)/", output.read_text())[0])
    assert "DUE TO TIME LIMIT" not in output.read_text(), log()
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=5"], env=slurm, check=True)

    resumed = checkpoint_from_step(checkpoints, time_limit_stop + 100)
    assert wait_for_job(slurm, job_id, 120, hurry_requeued=True, until=lambda *_: resumed()) == "RUNNING", log()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm, check=True)
    assert wait_for_job(slurm, job_id, 60, until=requeued(2)) == "PENDING", log()
    subprocess.run(["scancel", job_id], env=slurm, check=True)

    text = output.read_text()
    assert f"Slurm requeued job {job_id} (restart 1): resuming" in text, log()
    assert f"Resuming from {checkpoints}/ckpt-{time_limit_stop}" in text, log()
    scancel_stop = int(re.findall(r"stopped on SIGUSR1 at step (\d+)/", text)[1])
    uninterrupted = tmp_path / "uninterrupted"
    succeeded(launch("mpirun", 2, *run, "--max-steps", scancel_stop, "--threads-per-rank", 1,
                     "--checkpoint-dir", uninterrupted))
    expected, saved = checkpoint_values(uninterrupted, scancel_stop), checkpoint_values(checkpoints, scancel_stop)
    assert sorted(saved) == sorted(expected) and len(saved) > 3
    for name, value in expected.items():
        assert (saved[name] == value).all(), name
