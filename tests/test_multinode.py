"""Across hosts: a virtual cluster of 2 nodes (run/cluster: namespaces, a bridge, sshd on each),
2 ranks on each, launched from node1 as on a real cluster. The project and $HOME are shared;
each node's /tmp is its own, so every file the tests read is under the shared state directory."""
import os
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import (PYTHON, ROOT, assert_same_weights, checkpoint_from_step, ended_within, exported, id_images,
                      ids_by_rank, latest_checkpoint_step, output_lines, read_json, recorder, reported_accuracy,
                      run_job, run_recorded, saved_weights, start_and_wait, submit_job, succeeded, train_and_save)
from hvd_sgd.bench import launchers
from hvd_sgd.bench import project

# run/test's xdist workers run the cluster tests (this file's and test_slurm's) on one worker, in order.
pytestmark = [pytest.mark.slow, pytest.mark.multinode, pytest.mark.xdist_group("clusters")]
CLUSTER = ROOT / "run" / "cluster"
STATE = ROOT / ".cluster-test"
HOSTS = "node1:2,node2:2"
# Open MPI must use the cluster's network; horovodrun finds the common interface (eth0) itself.
MPIRUN_NETWORK = ["--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]


@pytest.fixture(scope="session")
def cluster():
    """Two nodes for the whole session, taken down whatever the tests do."""
    env = dict(os.environ, HVD_SGD_CLUSTER_DIR=str(STATE), HVD_SGD_CLUSTER_NET="10.213.58",
               HVD_SGD_CLUSTER_PREFIX="hvdtest", HVD_SGD_CLUSTER_SLURMCTLD_PORT="16937",
               HVD_SGD_CLUSTER_SLURMD_PORT="16938")
    try:
        up = subprocess.run([CLUSTER, "up", "--nodes", "2", "--slurm"], env=env, capture_output=True, text=True,
                            timeout=300)
        if up.returncode != 0:
            pytest.fail(f"the virtual cluster cannot start here: {(up.stderr.strip().splitlines() or ['?'])[-1]}")
        yield dict(env, SLURM_CONF=str(STATE / "slurm" / "slurm.conf"))
    finally:
        subprocess.run([CLUSTER, "down"], env=env, capture_output=True, timeout=120)


@pytest.fixture
def shared(cluster, request):
    """A directory every node sees (the nodes' /tmp are their own)."""
    path = STATE / "shared" / request.node.name.replace("[", "-").replace("]", "")
    path.mkdir(parents=True)
    return path


def node_command(cluster, node, command, extra_env=None):
    """``command`` on ``node`` (in the project directory there): the command line and its environment."""
    env = launchers.environment(**{k: cluster[k] for k in ("HVD_SGD_CLUSTER_DIR", "HVD_SGD_CLUSTER_NET",
                                                             "HVD_SGD_CLUSTER_PREFIX")}, **(extra_env or {}))
    return [CLUSTER, "exec", node, *map(str, command)], env


def on_node(cluster, node, command, timeout=300, extra_env=None, **popen):
    """Run ``command`` on ``node``: to its end, or (given Popen arguments) in the background."""
    full, env = node_command(cluster, node, command, extra_env)
    if popen:
        return subprocess.Popen(full, cwd=ROOT, env=env, text=True, **popen)
    return subprocess.run(full, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def across(launcher, np_=4, hosts=HOSTS):
    """The launcher's command line for ``np_`` ranks across the nodes, before the program."""
    if launcher == "mpirun":
        return [launchers.mpirun(), "--allow-run-as-root", "-np", np_, "-H", hosts, *MPIRUN_NETWORK,
                "-x", "PYTHONUNBUFFERED", "-x", "OMPI_MCA_mpi_yield_when_idle"]
    gloo = ["--gloo"] if launcher == "horovodrun-gloo" else []
    return [launchers.venv_bin("horovodrun"), "-np", np_, "-H", hosts, *gloo]


def train_across(cluster, launcher, *args, np_=4, hosts=HOSTS, timeout=300):
    return on_node(cluster, "node1", [*across(launcher, np_, hosts), PYTHON, "-m", "hvd_sgd.train",
                                      *args], timeout=timeout)


TINY = ["--model", "softmax", "--lr", "0.4", "--no-lr-scaling", "--train-examples", 2048, "--test-examples", 1000,
        "--max-steps", 30, "--seed", 3]


@pytest.fixture(scope="module")
def one_rank_with_four_times_the_batch(tmp_path_factory):
    return train_and_save(tmp_path_factory.mktemp("np1"), "np1", "python", 1, *TINY, "--batch-size", 32)


@pytest.mark.parametrize("launcher", ["horovodrun", "horovodrun-gloo", "mpirun"])
def test_every_launcher_runs_two_ranks_on_each_node(cluster, shared, launcher, one_rank_with_four_times_the_batch):
    """Placement as the host list says, and 2 nodes x 2 ranks x batch 8 train like 1 rank x batch 32."""
    metrics, model = shared / "m.json", shared / "m.keras"
    result = succeeded(train_across(cluster, launcher, *TINY, "--batch-size", 8, "--metrics-file", metrics,
                                    "--save-model", model))
    assert reported_accuracy(result) > 0.6  # it learned (chance is 0.1)
    summary = read_json(metrics)
    assert summary["world_size"] == 4
    placement = {r["rank"]: r for r in summary["ranks"]}
    assert sorted((r["host"], r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"])
                  for r in placement.values()) == [("node1", 0, 2, 0, 2), ("node1", 1, 2, 0, 2),
                                                   ("node2", 0, 2, 1, 2), ("node2", 1, 2, 1, 2)]
    assert placement[0]["host"] == "node1"  # rank 0, the chief, where the launcher runs
    for host in ("node1", "node2"):  # each node's two ranks on disjoint cores, but under Gloo (unbound)
        a, b = [r["cpus"] for r in placement.values() if r["host"] == host]
        assert set(a).isdisjoint(b) if launcher != "horovodrun-gloo" else a == b == sorted(os.sched_getaffinity(0)), \
            placement
    assert_same_weights(saved_weights(model), one_rank_with_four_times_the_batch, rtol=1e-4, atol=1e-5)


def test_two_nodes_stream_one_shared_copy_of_the_shards_and_train_like_one_rank(cluster, shared):
    """The shards on the file system every node sees, read by the 4 ranks of 2 nodes: each rank
    trains on its own examples only, which step by step make one rank's, and the weights are one
    rank's with 4 times the batch."""
    data = exported(shared / "set", "tfrecord", id_images(96, 20), shards=3)
    one_ids, one_weights, _ = run_recorded(shared, "np1", data, 1, 12, "--epochs", 2)
    recorder(shared)
    ids, model = shared / "ids", shared / "m.keras"
    ids.mkdir()
    succeeded(on_node(cluster, "node1", [*across("mpirun"), "-x", "PYTHONPATH", "-x", "IDS_DIR", PYTHON, "-m",
                                         "hvd_sgd.train", "--model", "recorder:model", "--data-dir", data,
                                         "--batch-size", 3, "--lr", 0.05, "--no-lr-scaling", "--epochs", 2,
                                         "--save-model", model],
                      extra_env=dict(PYTHONPATH=str(shared), IDS_DIR=str(ids))))
    ranks = ids_by_rank(ids, 4)
    assert all(r.shape == (16, 3) for r in ranks)
    np.testing.assert_array_equal(np.concatenate(ranks, axis=1), one_ids[0])
    assert_same_weights(saved_weights(model), one_weights, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("launcher", ["srun", "mpirun", "horovodrun"])
def test_the_job_script_runs_two_ranks_on_each_of_two_slurm_nodes(cluster, shared, launcher,
                                                                  one_rank_with_four_times_the_batch):
    output, metrics, model = shared / "job.out", shared / "m.json", shared / "m.keras"
    state = run_job(dict(cluster, LAUNCHER=launcher), "-N", 2, "--ntasks-per-node", 2, f"--output={output}",
                    ROOT / "run" / "slurm" / "train.sbatch", *TINY, "--batch-size", 8, "--metrics-file", metrics,
                    "--save-model", model)
    assert state == "COMPLETED", output.read_text()[-3000:] if output.exists() else state
    summary = read_json(metrics)
    assert sorted((r["host"], r["local_rank"]) for r in summary["ranks"]) == [
        ("node1", 0), ("node1", 1), ("node2", 0), ("node2", 1)]
    assert_same_weights(saved_weights(model), one_rank_with_four_times_the_batch, rtol=1e-4, atol=1e-5)


def test_resume_moves_between_two_nodes_and_one(cluster, shared, one_rank_with_four_times_the_batch):
    """Checkpointed on 2 nodes x 2 ranks, resumed on node1 alone (2 ranks x twice the batch), then
    back on both: the weights of one uninterrupted run (the same global batch throughout)."""
    checkpoints, final = shared / "ckpt", shared / "final.keras"
    succeeded(train_across(cluster, "mpirun", *TINY, "--batch-size", 8, "--max-steps", 10,
                           "--checkpoint-dir", checkpoints))
    succeeded(train_across(cluster, "mpirun", *TINY, "--batch-size", 16, "--max-steps", 20,
                           "--checkpoint-dir", checkpoints, "--resume", np_=2, hosts="node1:2"))
    succeeded(train_across(cluster, "mpirun", *TINY, "--batch-size", 8, "--checkpoint-dir", checkpoints, "--resume",
                           "--save-model", final))
    assert_same_weights(saved_weights(final), one_rank_with_four_times_the_batch, rtol=1e-4, atol=1e-5)


LONG = ["--model", "mlp", "--train-examples", 8192, "--test-examples", 500, "--batch-size", 64,
        "--epochs", 1000, "--log-every-steps", 10, "--checkpoint-every-steps", 20]


def start_long_run(cluster, shared, *args, env=None, np_=4, hosts=HOSTS, launcher="mpirun"):
    """A long run across both nodes, returned once its first checkpoint is there."""
    checkpoints = shared / "ckpt"
    command, environment = node_command(cluster, "node1", [*across(launcher, np_, hosts), PYTHON, "-m",
                                                           "hvd_sgd.train", *LONG, "--checkpoint-dir", checkpoints,
                                                           *args], env)
    return start_and_wait(command, checkpoint_from_step(checkpoints, 1), 180, environment), checkpoints


def rank_pids_on(cluster, node, launchers=()):
    """The training processes running on ``node`` (and those whose command line holds one of
    ``launchers``): in its network namespace (the PIDs are this machine's)."""
    namespace = f"{cluster['HVD_SGD_CLUSTER_PREFIX']}-{node}"
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True).stdout.split()
    ranks = []
    for pid in map(int, pids):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
        except OSError:
            continue  # ended since the listing
        if argv[:3] == [PYTHON, "-m", "hvd_sgd.train"] or any(name in " ".join(argv) for name in launchers):
            ranks.append(pid)
    return ranks


def test_a_stalled_rank_on_the_other_node_is_named_with_its_host(cluster, shared):
    stall_timeout = 12  # start-up is not a stall: under load (xdist's other worker) a phase can take 5 s
    run, _ = start_long_run(cluster, shared, "--stall-timeout", stall_timeout)
    victims = rank_pids_on(cluster, "node2")
    assert victims, "no rank found on node2"
    os.kill(victims[0], signal.SIGSTOP)  # one PID space: the nodes' processes are this machine's
    stopped = time.monotonic()
    status, stdout, stderr = ended_within(run, 60)
    assert status != 0 and time.monotonic() - stopped < stall_timeout + 15
    lines = [line for line in output_lines(stderr) if "stopped responding" in line]
    assert len(lines) == 1 and "(node2) stopped responding" in lines[0], stderr[-3000:]


def test_a_checkpoint_directory_in_use_on_one_node_is_refused_on_the_other(cluster, shared):
    checkpoints = shared / "ckpt"
    holder = on_node(cluster, "node1", [PYTHON, "-c", "import sys, time; from hvd_sgd.training import checkpoint; "
                                        "checkpoint.lock_directory(sys.argv[1], 'test'); print('locked', flush=True); "
                                        "time.sleep(300)", checkpoints], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "locked"
        second = on_node(cluster, "node2", [PYTHON, "-m", "hvd_sgd.train", *LONG, "--checkpoint-dir", checkpoints,
                                            "--resume"], timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode != 0 and "Traceback" not in second.stderr
    lines = [line for line in second.stderr.splitlines() if "hvd_sgd.train: error:" in line]
    assert len(lines) == 1 and "is in use by another run (host node1, pid" in lines[0], second.stderr[-3000:]


# 384 steps: node2 is back on 4 ranks after about 40 of them (measured on the fast type with 640:
# 4 ranks at 12 s, 2 at 17 s, 4 again at 22.5 s); the 4 ranks then take some 8 s for the rest.
ELASTIC_EPOCHS = 20
ELASTIC = ["--model", "mlp", "--train-examples", 8192, "--test-examples", 1000, "--batch-size", 32, "--epochs",
           ELASTIC_EPOCHS, "--threads-per-rank", 1, "--log-every-steps", 20, "--elastic"]


def test_elastic_training_goes_on_without_a_node_and_takes_it_back(cluster, shared):
    """node2 leaves the discovery output mid-run: node1's ranks go on; node2 comes back: its new
    workers join, and the 4 ranks finish every step of the run."""
    hosts, metrics = shared / "hosts", shared / "m.json"
    hosts.write_text("node1:2\nnode2:2\n")
    command = [launchers.venv_bin("horovodrun"), "-np", 4, "--min-np", 2, "--max-np", 4,
               "--host-discovery-script", ROOT / "run" / "discover-hosts", PYTHON, "-m", "hvd_sgd.train", *ELASTIC,
               "--metrics-file", metrics]
    run = on_node(cluster, "node1", command, extra_env=dict(HVD_SGD_HOSTS_FILE=str(hosts)),
                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    sizes = []  # the number of ranks at each (re)start, as rank 0 logs it

    def read_output():
        for line in run.stdout:
            # horovodrun's own messages ("… exit with status code …") can land on the same line.
            restart = re.search(r"elastic \(re\)start at step \d+ with (\d+) rank", line)
            if restart:
                sizes.append(int(restart.group(1)))

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()

    def wait_until(condition, what, seconds=180):
        deadline = time.monotonic() + seconds
        while not condition():
            assert run.poll() is None, f"the run ended before {what}: restarts with {sizes}"
            assert time.monotonic() < deadline, f"no {what} in {seconds} s: restarts with {sizes}"
            time.sleep(0.2)

    try:
        wait_until(lambda: sizes == [4], "start on 4 ranks")
        time.sleep(3)  # some training on both nodes
        hosts.write_text("node1:2\n")
        wait_until(lambda: sizes[-1] == 2, "restart on node1's 2 ranks")
        hosts.write_text("node1:2\nnode2:2\n")
        wait_until(lambda: sizes[-1] == 4, "restart with node2 back")
        assert run.wait(timeout=300) == 0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    reader.join(timeout=10)
    summary = read_json(metrics)
    assert sizes == [4, 2, 4], sizes
    assert summary["world_size"] == 4 and summary["steps"] == ELASTIC_EPOCHS * (8192 // 128)
    assert sorted(rank["host"] for rank in summary["ranks"]) == ["node1", "node1", "node2", "node2"]


# The launcher must notice a node that stopped answering: Open MPI's daemons (orted) keep a TCP
# connection to mpirun, idle while training runs, and by default probe it only after 300 s.
# The job script's settings are 10, 5 and 3 (about 25 s); the test's, about 6 s.
def test_the_network_suite_measures_across_two_nodes_of_its_own_cluster(tmp_path):
    """The bench's network suite, quick, on a 10 Gbit/s link: it brings its own cluster up and down
    and reports all-reduce bandwidth and training efficiency across the nodes (figures, not timings);
    the projection fits its cost model to them and projects to 512 ranks, on this CPU and on a GPU class."""
    bench = subprocess.run([PYTHON, "-m", "hvd_sgd.bench", "--quick", "--suites", "network,project", "--links",
                            "10gbit", "--results-dir", tmp_path], capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stderr[-3000:]
    suites = read_json(tmp_path / "results.json")["suites"]
    fit, [check] = suites["project"]["links"]["10gbit"], suites["project"]["validation"]
    # The link is shaped to 10 Gbit/s (1.25 GB/s): no size's measured bus bandwidth exceeds it. (Not the
    # fit's: from --quick's four sizes it can trade latency for bandwidth and overshoot the link.)
    measured = suites["network"]["10gbit"]["allreduce"]["mpi"]["horovod"]
    assert 0 < max(measured) <= 1.1 * 1.25 and 0 < fit["bandwidth"] and check["model"] == "softmax", (measured, fit)
    assert 0 < check["predicted"] <= 1 and check["measured"] == suites["network"]["10gbit"]["softmax"]["ratio"]
    # softmax's 2 gradients in 1 or 2 operations a step, and every 10 steps the stop request's
    assert 1 <= check["ops_per_step"] == suites["network"]["10gbit"]["ops_per_step"]["softmax"] <= 2.2
    projected = suites["project"]["projection"]
    assert {r["compute"] for r in projected} == {"this CPU (measured)", project.GPU["name"], project.H200["name"]}
    # A ring's all-reduce grows with the ranks: for each model, compute and interconnect, efficiency falls.
    for line in {(r["model"], r["compute"], r["interconnect"]) for r in projected}:
        rows = sorted((r["ranks"], r["efficiency"]) for r in projected if (r["model"], r["compute"], r["interconnect"]) == line)
        assert [n for n, _ in rows] == [2, 8, 64, 512] and all(a >= b for (_, a), (_, b) in zip(rows, rows[1:])), rows
    # softmax's one layer can overlap nothing: its overlap bound is one operation after the step
    assert check["overlapped_ops"] == 1 and check["predicted"] <= check["overlapped"] <= 1, check
    assert (tmp_path / "project.png").exists() and "## project" in (tmp_path / "results.md").read_text()
    row = suites["network"]["10gbit"]
    allreduce = row["allreduce"]["mpi"]
    assert len(allreduce["horovod"]) == len(allreduce["mpi4py"]) == len(allreduce["sizes"]) > 0
    assert min(allreduce["horovod"] + allreduce["mpi4py"]) > 0 and 0 < row["softmax"]["ratio"]
    parts = row["decomposition"]["softmax"]  # across hosts: each part of the ranks' step and the ceiling's
    for who in ("ranks", "ceiling"):
        assert parts[who]["wait"] >= 0 and parts[who]["allreduce"] >= 0 and parts[who]["compute"] > 0, parts
    assert (tmp_path / "network_10gbit.png").exists() and "## network" in (tmp_path / "results.md").read_text()
    assert not (tmp_path / "cluster" / "nodes").exists()  # taken down


def cut_off(cluster, node):
    """Every link of ``node`` down; returns the function that brings them up again."""
    namespace = f"{cluster['HVD_SGD_CLUSTER_PREFIX']}-{node}"
    subprocess.run(["ip", "-n", namespace, "link", "set", "eth0", "down"], check=True)
    return lambda: subprocess.run(["ip", "-n", namespace, "link", "set", "eth0", "up"], check=True)


def assert_one_line_names_the_node(stderr, saying):
    """One line of the job's output names node2, and it says ``saying``; no traceback."""
    naming = [line for line in output_lines(stderr) if "node2" in line]
    assert len(naming) == 1 and saying in naming[0], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def assert_nothing_left(cluster, node, seconds=60, launchers=("mpirun", "horovodrun")):
    """No rank, and no process of ``launchers``, on ``node`` within ``seconds``."""
    deadline = time.monotonic() + seconds
    while rank_pids_on(cluster, node, launchers):
        assert time.monotonic() < deadline, f"processes of the job left running on {node}"
        time.sleep(0.5)


def assert_node1_resumes_from_the_last_checkpoint(cluster, checkpoints):
    """node1 alone resumes from the last checkpoint written before the loss, as it is: intact, not
    skipped as damaged for an earlier one."""
    last = latest_checkpoint_step(checkpoints)
    resumed = succeeded(train_across(cluster, "mpirun", *LONG, "--batch-size", 128, "--max-steps", 200,
                                     "--checkpoint-dir", checkpoints, "--resume", np_=2, hosts="node1:2"))
    lines = output_lines(resumed.stdout)
    assert f"Resuming from {checkpoints}/ckpt-{last}" in lines and not any("Skipping" in line for line in lines), lines


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun", "horovodrun-gloo"])
def test_a_node_cut_off_ends_the_job_within_a_minute_with_nothing_set(cluster, shared, launcher):
    """node2's link cut under each launcher, started as the guide starts it, nothing exported: the job
    ends non-zero within 60 s with a line naming node2, nothing is left running on node1, the last
    checkpoint is intact, and node1 alone resumes from it."""
    run, checkpoints = start_long_run(cluster, shared, launcher=launcher)
    lost, restore = time.monotonic(), cut_off(cluster, "node2")
    try:
        status, stdout, stderr = ended_within(run, 90)
        assert status != 0 and time.monotonic() - lost < 60, (time.monotonic() - lost, stderr[-3000:])
        # The installation's mpirun: "node node2 lost (…)"; under Gloo, the watchdog's link: "rank(s) 2
        # (node2), 3 (node2) silent for 15 s …".
        assert_one_line_names_the_node(stderr, "hvd_sgd: error: node node2 lost" if launcher != "horovodrun-gloo"
                                       else "hvd_sgd: error: rank(s) ")
        assert_nothing_left(cluster, "node1")
    finally:
        restore()
    assert_nothing_left(cluster, "node2")  # once its link is back, its ranks find themselves alone and end
    assert_node1_resumes_from_the_last_checkpoint(cluster, checkpoints)


def test_a_node_cut_off_ends_a_slurm_job_within_a_minute(cluster, shared):
    """The job script with srun: its ranks, srun and the script end on node1 within 60 s of node2's
    cut, with the watchdog's line naming node2. (Under the script's mpirun and horovodrun the line is
    the installation's mpirun's, as in the test above. Slurm keeps the job COMPLETING until slurmctld
    declares node2 down, after its SlurmdTimeout: the site's setting.)"""
    output, checkpoints = shared / "job.out", shared / "ckpt"
    submit_job(dict(cluster, LAUNCHER="srun"), "-N", 2, "--ntasks-per-node", 2, f"--output={output}",
               ROOT / "run" / "slurm" / "train.sbatch", *LONG, "--checkpoint-dir", checkpoints)
    deadline = time.monotonic() + 180
    while not checkpoint_from_step(checkpoints, 1)():
        assert time.monotonic() < deadline, output.read_text()[-3000:] if output.exists() else "no output"
        time.sleep(0.5)
    restore = cut_off(cluster, "node2")
    try:
        assert_nothing_left(cluster, "node1", seconds=60, launchers=("train.sbatch", "srun"))
        assert_one_line_names_the_node(output.read_text(), "hvd_sgd: error: rank(s) ")
    finally:
        restore()


# Last in this file: a killed node is gone for good.
def test_a_node_whose_processes_are_killed_ends_the_job_at_once_and_the_survivor_resumes(cluster, shared):
    """Every process of node2 killed: the job ends within seconds naming node2, and node1 alone
    resumes from the last checkpoint."""
    run, checkpoints = start_long_run(cluster, shared)
    namespace = f"{cluster['HVD_SGD_CLUSTER_PREFIX']}-node2"
    lost = time.monotonic()
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    subprocess.run(["kill", "-9", *pids])
    status, stdout, stderr = ended_within(run, 90)
    assert status != 0 and time.monotonic() - lost < 15
    assert_one_line_names_the_node(stderr, "hvd_sgd: error: node node2 lost")  # not ssh's, Open MPI's and each rank's
    assert_nothing_left(cluster, "node1")
    assert_node1_resumes_from_the_last_checkpoint(cluster, checkpoints)
