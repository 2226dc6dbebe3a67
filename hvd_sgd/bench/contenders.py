"""The contenders, each started as its own process tree; their images per second (or GB/s, seconds)."""
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import tempfile
import time

from hvd_sgd import launchers
from hvd_sgd.bench import protocol

GLOBAL_BATCH = {"softmax": 200, "cnn": 128}  # softmax: the seed's 100 per rank on 2 ranks


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Contenders across the nodes of a cluster, one rank per host of ``hosts``: launched on the
    first node by the command prefix ``run_on_first``; files they write go under ``shared_dir``
    (a node's /tmp is its own); ``mpirun_options`` choose the cluster's network."""
    run_on_first: tuple
    hosts: str
    mpirun_options: tuple
    shared_dir: str

    def command(self, launcher, np_, module, args):
        return [*self.run_on_first, *launchers.command(launcher, np_, module, args, self.mpirun_options, self.hosts)]


def _start(command, threads, **env):
    return subprocess.Popen(list(map(str, command)), env=launchers.environment(OMP_NUM_THREADS=str(threads), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _command(launcher, np_, module, args, nodes=None):
    """The launcher's command line here, or across ``nodes``."""
    return (nodes.command if nodes else launchers.command)(launcher, np_, module, args)


def _worker(launcher, np_, kind, *args, nodes=None):
    return _command(launcher, np_, "hvd_sgd.bench", protocol.worker_args(kind, *args), nodes)


def _results(processes, timeout=900):
    """Wait for the processes; what they reported through the protocol."""
    found = []
    for p in processes:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args[:8])}... failed ({p.returncode}):\n{err[-3000:]}")
        found += protocol.results(out)
    return found


def _train(np_, args, timeout=900, nodes=None):
    """``hvd_sgd.train`` as a user runs it (horovodrun for 2+ ranks); its metrics file and wall seconds."""
    with tempfile.TemporaryDirectory(dir=nodes and nodes.shared_dir) as tmp:
        metrics = os.path.join(tmp, "m.json")
        command = _command("python" if np_ == 1 else "horovodrun", np_, "hvd_sgd.train",
                           [*args, "--metrics-file", metrics], nodes)
        started = time.perf_counter()
        _results([_start(command, 1)], timeout)
        seconds = time.perf_counter() - started
        with open(metrics) as f:
            return json.load(f), seconds


def hvd_sgd_throughput(np_, model, steps, nodes=None):
    """hvd_sgd itself, as a user runs it: its own img/s figure. Across ``nodes``, one thread per
    rank: the nodes of a virtual cluster share this machine's cores."""
    threads = ["--threads-per-rank", 1] if nodes else []
    metrics, _ = _train(np_, ["--model", model, "--batch-size", GLOBAL_BATCH[model] // np_, "--max-steps", steps,
                              "--test-examples", 1000, "--log-every-steps", 10 ** 6, *threads], nodes=nodes)
    return metrics["images_per_second"]


def keras_throughput(model, batch, steps, threads, copies=1):
    """Plain Keras without Horovod; ``copies`` independent processes at once: their img/s each."""
    return [r["images_per_second"] for r in _results(
        [_start(_worker("python", 1, "keras", model, batch, steps, threads), threads) for _ in range(copies)])]


def mwms_throughput(model, global_batch, steps, workers, threads):
    cluster = {"worker": [f"localhost:{p}" for p in _free_ports(workers)]}
    processes = [_start(_worker("python", 1, "mwms", model, global_batch, steps, threads), threads,
                        TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
                 for i in range(workers)]
    return _results(processes)[0]["images_per_second"]


def allreduce_bandwidth(controller, sizes, nodes=None):
    """hvd.allreduce under the given controller; raw MPI (mpi4py, in processes without Horovod) beside the MPI one."""
    sizes = ",".join(map(str, sizes))
    launcher = "mpirun" if controller == "mpi" else "horovodrun-gloo"
    result = _results([_start(_worker(launcher, 2, "allreduce", "horovod", sizes, nodes=nodes), 1)])[0]
    raw = _results([_start(_worker("mpirun", 2, "allreduce", "mpi4py", sizes, nodes=nodes), 1)])[0] \
        if controller == "mpi" else {}
    return dict(sizes=result["sizes"], horovod=result["bandwidth"], mpi4py=raw.get("bandwidth", []),
                mpi4py_fixed_buffers=raw.get("bandwidth_fixed", []))


def time_to_accuracy(np_, quick):
    target = 0.9 if quick else 0.99
    subset = ["--train-examples", 4000, "--test-examples", 1000, "--epochs", 1] if quick else ["--epochs", 8]
    m, seconds = _train(np_, ["--model", "cnn", "--batch-size", GLOBAL_BATCH["cnn"] // np_,
                              "--target-accuracy", target, *subset], timeout=3600)
    return dict(target=target, seconds=seconds, accuracy=m["test_accuracy"], epochs=m["epochs"],
                reached=m["test_accuracy"] >= target)


def _free_ports(n):
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]


# The contenders of the paired suites: each takes (model, steps) and returns images per second.
CORES = os.cpu_count() or 1


def hvd_sgd_np1(model, steps):
    return hvd_sgd_throughput(1, model, steps)


def hvd_sgd_np2(model, steps):
    return hvd_sgd_throughput(2, model, steps)


def keras_np1(model, steps):
    return keras_throughput(model, GLOBAL_BATCH[model], steps, CORES)[0]


def independent_2x1(model, steps):
    return sum(keras_throughput(model, GLOBAL_BATCH[model] // 2, steps, max(1, CORES // 2), copies=2))


def mwms_np2(model, steps):
    return mwms_throughput(model, GLOBAL_BATCH[model], steps, 2, max(1, CORES // 2))


