"""The contenders, each started as its own process tree; their images per second (or GB/s, seconds)."""
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import socket
import statistics
import subprocess
import tempfile
import time

from hvd_sgd import runtime
from hvd_sgd.bench import launchers, protocol

# softmax: the seed's 100 per rank on 2 ranks; cnn: its default, 32 per rank.
GLOBAL_BATCH = {"softmax": 200, "classic_cnn": 128, "cnn": 64, "resnet20": 128}
EXAMPLES_PER_EPOCH = 60000  # MNIST's training set, which every contender trains on


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


def _start(command, threads, cpus=None, **env):
    """``command`` started, bound to ``cpus`` if given (as a launcher binds a rank: the process keeps that mask)."""
    bound = ["taskset", "--cpu-list", ",".join(map(str, cpus))] if cpus else []
    return subprocess.Popen(list(map(str, [*bound, *command])),
                            env=launchers.environment(OMP_NUM_THREADS=str(threads), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _command(launcher, np_, module, args, nodes=None, options=()):
    """The launcher's command line here, or across ``nodes``; ``options``: mpirun's, here."""
    if nodes:
        return nodes.command(launcher, np_, module, args)
    return launchers.command(launcher, np_, module, args, before_program=options)


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


def _train(np_, args, timeout=900, nodes=None, launcher="horovodrun", env=None, cpus=None, options=()):
    """``hvd_sgd.train`` as a user runs it (``launcher`` for 2+ ranks, with mpirun's ``options``; on
    ``cpus`` if given); its metrics file, and when the command started and ended (time.time(), as
    the metrics file's timeline)."""
    with tempfile.TemporaryDirectory(dir=nodes and nodes.shared_dir) as tmp:
        metrics = os.path.join(tmp, "m.json")
        command = _command("python" if np_ == 1 else launcher, np_, "hvd_sgd.train",
                           [*args, "--metrics-file", metrics], nodes, options)
        launched = time.time()
        _results([_start(command, 1, cpus, **(env or {}))], timeout)
        ended = time.time()
        with open(metrics) as f:
            return json.load(f), launched, ended


def _throughput_args(np_, model, steps, nodes, examples=EXAMPLES_PER_EPOCH):
    threads = ["--threads-per-rank", 1] if nodes else []
    epochs = math.ceil(steps * GLOBAL_BATCH[model] / examples)  # enough for --max-steps to end the run
    return ["--model", model, "--batch-size", GLOBAL_BATCH[model] // np_, "--max-steps", steps, "--epochs", epochs,
            "--test-examples", 1000, "--log-every-steps", 10 ** 6, *threads]


def hvd_sgd_throughput(np_, model, steps, nodes=None, extra=()):
    """hvd_sgd itself, as a user runs it (with the flags ``extra``): its own img/s figure. Across
    ``nodes``, one thread per rank: the nodes of a virtual cluster share this machine's cores."""
    metrics, *_ = _train(np_, [*_throughput_args(np_, model, steps, nodes), *extra], nodes=nodes)
    return metrics["images_per_second"]


def recipe(np_, *args):
    """The default recipe (with ``args``) on ``np_`` ranks under mpirun, as run/train starts it: its
    metrics, and the command's start and end."""
    return _train(np_, list(args), launcher="mpirun")


def layout_throughput(ranks, args):
    """hvd_sgd on ``ranks`` ranks of this machine, unbound by mpirun, so that each binds to its share
    of the cores and runs as many threads (bench.layout): its own img/s figure."""
    metrics, *_ = _train(ranks, args, launcher="mpirun", options=("--bind-to", "none"))
    return metrics["images_per_second"]


def input_sets(directory, examples, test_examples, size, colour):
    """Write the input suite's data sets under ``directory`` (workers.image_sets)."""
    _results([_start(_worker("python", 1, "image_sets", directory, examples, test_examples, size, int(colour)), CORES)])


def streamed_throughput(data_dir, examples, model, steps):
    """hvd_sgd on 2 ranks, as a user runs it, on ``--data-dir data_dir``: its own img/s figure."""
    metrics, *_ = _train(2, [*_throughput_args(2, model, steps, None, examples), "--data-dir", data_dir])
    return metrics["images_per_second"]


def decode_rate(directory, threads):
    """Images a second read and decoded from the input suite's image folder on ``threads`` parallel calls."""
    return _results([_start(_worker("python", 1, "decode", directory, threads), threads)])[0]["images_per_second"]


def evaluation_seconds(data, model, repeats):
    """2 ranks evaluating ``data``'s test set (workers.evaluation): rank 0 alone and every rank on
    its share, each ``repeats`` times, alternating."""
    return _results([_start(_worker("mpirun", 2, "evaluation", data, model, repeats), 1)])[0]


def allreduce_ops_per_step(np_, model, steps, nodes=None):
    """All-reduce operations per step of a run like hvd_sgd_throughput's, its own, with Horovod's
    timeline on (rank 0 writes it; the timeline slows a run, so its speed is not measured here).
    Horovod fuses the gradients that are ready together; at hvd_sgd's 0 ms cycle the first ones
    go while the backward pass still computes the rest, so a step makes one operation or several."""
    with tempfile.TemporaryDirectory(dir=nodes and nodes.shared_dir) as tmp:
        timeline = os.path.join(tmp, "timeline.json")
        # horovodrun: every rank must see HOROVOD_TIMELINE (Horovod fails if only rank 0 does), and
        # horovodrun passes its environment to the ranks on every host
        _train(np_, _throughput_args(np_, model, steps, nodes), nodes=nodes, env=dict(HOROVOD_TIMELINE=timeline))
        with open(timeline) as f:
            return _allreduce_operations(f.read()) / steps


def _allreduce_operations(timeline):
    """Operations in a Horovod timeline: each tensor of a fused operation has its own row, whose
    MPI_ALLREDUCE begins within the operation; the next operation begins after it ended."""
    text = timeline.rstrip().rstrip(",")  # Horovod leaves the list open until it shuts down
    events = json.loads(text if text.endswith("]") else text + "]")
    open_spans, spans = {}, []
    for e in events:
        if e.get("ph") == "B":
            open_spans.setdefault(e["pid"], []).append(e)
        elif e.get("ph") == "E" and open_spans.get(e["pid"]):
            begin = open_spans[e["pid"]].pop()
            if begin["name"] == "MPI_ALLREDUCE":
                spans.append((begin["ts"], e["ts"]))
    operations, ends_by = 0, -1
    for start, end in sorted(spans):
        if start > ends_by:  # after every tensor of the current operation ended: a new one
            operations, ends_by = operations + 1, end
        else:
            ends_by = min(ends_by, end)
    return operations


def keras_throughput(model, batch, steps, threads):
    """Plain Keras without Horovod."""
    return _results([_start(_worker("python", 1, "keras", model, batch, steps, threads), threads)])[0][
        "images_per_second"]


def mwms_throughput(model, global_batch, steps, workers, threads):
    cluster = {"worker": [f"localhost:{p}" for p in _free_ports(workers)]}
    processes = [_start(_worker("python", 1, "mwms", model, global_batch, steps, threads), threads,
                        TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
                 for i in range(workers)]
    return _results(processes)[0]["images_per_second"]


def alternating(contenders, rounds):
    """``rounds`` runs of each contender, one after the other, the order reversed every other
    round: this machine's speed drifts over minutes, so neither goes first every time."""
    for i in range(rounds):
        yield from contenders if i % 2 == 0 else reversed(contenders)


def allreduce_bandwidth(controller, sizes, rounds, blocks, nodes=None):
    """hvd.allreduce under the given controller; beside the MPI one, raw MPI (mpi4py) in the same
    processes, timed block by block in turn with it (``blocks`` of each a size).

    ``rounds`` runs: per size each library's median bus bandwidth and, for MPI, the per-round
    ratios hvd / mpi4py (each the median over the round's pairs of blocks)."""
    launcher, libraries = ("mpirun", "horovod,mpi4py") if controller == "mpi" else ("horovodrun-gloo", "horovod")
    command = _worker(launcher, 2, "allreduce", libraries, ",".join(map(str, sizes)), blocks, nodes=nodes)
    runs = [_results([_start(command, 1)])[0] for _ in range(rounds)]

    def median(key):
        return [statistics.median(by_size) for by_size in zip(*(r[key] for r in runs))] if key in runs[0] else []

    ratios = [r["horovod_over_mpi4py"] for r in runs if "mpi4py" in r]
    return dict(sizes=runs[0]["sizes"], horovod=median("horovod"), mpi4py=median("mpi4py"),
                mpi4py_fixed_buffers=median("mpi4py_fixed_buffers"), ratios=[list(by_size) for by_size in zip(*ratios)])


# Start-up's phases, each ending at the timeline's mark of that name ("end": the command's end).
PHASES = (("launch and imports", "imports"), ("hvd.init", "horovod"), ("data", "data"),
          ("model and broadcast", "model"), ("first step (tracing)", "first_step"), ("training", "training"),
          ("evaluation, files, exit", "end"))


def time_to_accuracy(contender, quick):
    """The default recipe, started as a user starts it, as ``contender`` (hvd_sgd_np1, hvd_sgd_np2,
    keras): wall seconds from the command to the first evaluation at the target, the run's
    accuracy curve and where its seconds went. 2 ranks start as run/train starts them, under
    mpirun (horovodrun imports TensorFlow before it starts the ranks: seconds more)."""
    target, subset = (0.9, [2048, 500, 1]) if quick else (0.99, [0, 0, 2])
    if contender == "keras":
        launched = time.time()
        metrics = _results([_start(_worker("python", 1, "keras_recipe", *subset, CORES), CORES)], 900)[0]
        ended = time.time()
    else:
        args = ["--train-examples", subset[0], "--test-examples", subset[1], "--epochs", subset[2]] if quick else []
        metrics, launched, ended = _train(int(contender[-1]), args, launcher="mpirun")
    marks = dict(metrics["timeline"], end=ended)
    reached = next((e for e in metrics["evaluations"] if e["accuracy"] >= target), None)
    return dict(target=target, seconds=ended - launched, accuracy=metrics["test_accuracy"],
                to_target=reached and reached["time"] - launched, epochs_to_target=reached and reached["epoch"],
                curve=[(e["time"] - launched, e["accuracy"]) for e in metrics["evaluations"]],
                startup={name: marks[mark] - previous for (name, mark), previous
                         in zip(PHASES, [launched] + [marks[m] for _, m in PHASES[:-1]])})


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
    return keras_throughput(model, GLOBAL_BATCH[model], steps, CORES)


def independent_2x1(model, steps, bound=True):
    """The ceiling of 2 ranks: their work with nothing to all-reduce, as two 1-rank hvd_sgd runs at
    once (half the global batch each; on 1 rank Horovod's optimizer reduces nothing), placed as
    the ranks are: ``bound`` to half of the CPUs each, as hvd_sgd binds 2 ranks on one host (the
    virtual cluster's ranks, one a node, are not). hvd_sgd's own step, not plain Keras': a short
    step differs between the two loops."""
    halves = [runtime.cpu_slice(i, 2) for i in range(2)]
    args = [*_throughput_args(2, model, steps, None), "--threads-per-rank", max(1, len(halves[0]))]
    if not (bound and halves[0]):
        halves = [None, None]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return sum(pool.map(lambda half: _train(1, args, cpus=half)[0]["images_per_second"], halves))


def decomposed(model, steps, blocks, np_=2, nodes=None):
    """hvd_sgd's step on ``np_`` ranks of one job, in its parts, beside the ceiling's (the same ranks
    training with no all-reduce) and hvd_sgd's own ``fit``, in alternating blocks
    (workers.decompose); across ``nodes``, one thread a rank, as the network suite's other contenders."""
    args = (model, GLOBAL_BATCH[model], steps, 1 if nodes else 0, blocks)
    return _results([_start(_worker("mpirun", np_, "decompose", *args, nodes=nodes), 1)])[0]


def mwms_np2(model, steps):
    return mwms_throughput(model, GLOBAL_BATCH[model], steps, 2, max(1, CORES // 2))


