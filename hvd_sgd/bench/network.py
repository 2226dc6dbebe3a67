"""The network suite: all-reduce and training across 2 nodes of the virtual cluster (run/cluster),
with the links unshaped, then shaped by tc to 10 Gbit/s and to 1 Gbit/s.

The nodes are network namespaces of this machine: they share its cores, so from one row to the
next only the network changes. One rank per node; the baseline for training is the same two
ranks' work with no all-reduce (two independent processes). Needs root, as run/cluster does.
"""
import contextlib
import os
import pathlib
import subprocess

from hvd_sgd.bench import launchers
from hvd_sgd.bench import contenders, decomposition

CLUSTER = pathlib.Path(__file__).resolve().parents[2] / "run" / "cluster"
LINKS = {"unshaped": [], "10gbit": ["--rate", "10gbit"], "1gbit": ["--rate", "1gbit"]}
# The cost model fits hvd.allreduce's medians, not the ratio to raw MPI: fewer blocks than the
# allreduce suite's, as at 1 Gbit/s a block of 64 MiB lasts seconds.
ALLREDUCE_BLOCKS = 5
TIMELINE_STEPS = 300  # enough to count a step's all-reduce operations; Horovod's timeline slows a run
# Its own subnet and names: apart from a user's cluster (10.213.57) and the tests' (10.213.58).
CLUSTER_ENV = dict(HVD_SGD_CLUSTER_NET="10.213.59", HVD_SGD_CLUSTER_PREFIX="hvdbench")


@contextlib.contextmanager
def two_nodes(link, state_dir):
    """A 2-node cluster with ``link`` shaping, taken down whatever happens: the Nodes to run on."""
    env = launchers.environment(HVD_SGD_CLUSTER_DIR=state_dir, **CLUSTER_ENV)
    try:
        up = subprocess.run([CLUSTER, "up", "--nodes", "2", *LINKS[link]], env=env, capture_output=True, text=True)
        if up.returncode != 0:
            raise RuntimeError(f"run/cluster up failed: {(up.stderr.strip().splitlines() or ['?'])[-1]}")
        on_first = ("env", *(f"{k}={v}" for k, v in env.items() if k.startswith("HVD_SGD_CLUSTER")),
                    CLUSTER, "exec", "node1")
        shared = os.path.join(state_dir, "shared")
        os.makedirs(shared, exist_ok=True)
        # Open MPI would try every interface it finds; horovodrun picks the one common to the hosts.
        yield contenders.Nodes(on_first, "node1:1,node2:1",
                               ("--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"), shared)
    finally:
        subprocess.run([CLUSTER, "down"], env=env, capture_output=True)


def run(plan, paired, steps, models):
    """Per link: all-reduce bandwidth (hvd over MPI and Gloo, mpi4py) and, per model, hvd_sgd on
    2 nodes against 2 independent processes (``paired``, ``plan.rounds`` times) and hvd_sgd's
    all-reduce operations per step. ``plan.quick``: the MPI controller and the first model only
    (each contender is a start of TensorFlow)."""
    controllers, models = (("mpi",), models[:1]) if plan.quick else (("mpi", "gloo"), models)
    results = {}
    for link in plan.links or LINKS:
        with two_nodes(link, os.path.abspath(os.path.join(plan.results_dir, "cluster"))) as nodes:
            def hvd_sgd_2_nodes(model, n):
                return contenders.hvd_sgd_throughput(2, model, n, nodes)

            # Not bound, as the nodes' ranks run (horovodrun); named as the contender: the row's key.
            def independent_2x1(model, n):
                return contenders.independent_2x1(model, n, bound=False)

            blocks = min(plan.allreduce_blocks, ALLREDUCE_BLOCKS)
            row = dict(allreduce={c: contenders.allreduce_bandwidth(c, plan.allreduce_sizes, plan.rounds, blocks, nodes)
                                  for c in controllers}, ops_per_step={}, decomposition={})
            for model in models:
                row[model] = paired((hvd_sgd_2_nodes, independent_2x1), model, steps[model], plan.rounds)
                # what the cost model charges latency for: a short run of its own, with Horovod's timeline on
                row["ops_per_step"][model] = contenders.allreduce_ops_per_step(
                    2, model, min(steps[model], TIMELINE_STEPS), nodes)
                # where the 2 nodes' step goes, against the same ranks' with no all-reduce (bench/decomposition.py)
                row["decomposition"][model] = decomposition.row(
                    contenders.decomposed(model, steps[model], plan.decomposition_blocks, nodes=nodes))
        print(f"   {link}: {row}", flush=True)
        results[link] = row
    return results


def model_rows(row):
    """A link's rows of the paired measurements, by model."""
    return {name: r for name, r in row.items() if name not in ("allreduce", "ops_per_step", "decomposition")}
