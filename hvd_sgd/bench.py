"""Benchmarks: hvd_sgd side by side with plain Keras, independent processes and MWMS.

    python -m hvd_sgd.bench [--quick] [--results-dir results/bench] [--suites overhead,scaling,...]

Every suite runs its contenders back to back in this one invocation, on the same model, data,
global batch and number of timed steps (all but the first, which traces the graph), and reports
ratios: this machine is shared and noisy, so absolute times mean little.

1. overhead   hvd_sgd on 1 rank vs a plain Keras ``fit`` loop without Horovod
2. scaling    hvd_sgd on 2 ranks vs two independent 1-rank Keras trainings at once (the ceiling)
3. peer       hvd_sgd on 2 ranks vs tf.distribute.MultiWorkerMirroredStrategy with 2 workers
4. allreduce  bus bandwidth of hvd.allreduce (MPI and Gloo controllers) vs mpi4py's Allreduce
5. tta        wall time for the CNN to reach the target test accuracy with 1 and 2 ranks

Each contender is a separate process tree; the ``worker`` sub-commands below are what those
processes run. Output: results.json, results.md and PNG plots in the results directory.
"""
import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

SUITES = ("overhead", "scaling", "peer", "allreduce", "tta")
MODELS = ("softmax", "cnn")
GLOBAL_BATCH = {"softmax": 200, "cnn": 128}  # softmax: the seed's 100 per rank on 2 ranks
TARGETS = [  # (name, suite, model, measured ratio key, minimum)
    ("CNN 2 ranks >= 1.15 x MWMS", "peer", "cnn", "ratio", 1.15),
    ("CNN scaling efficiency >= 0.90", "scaling", "cnn", "ratio", 0.90),
    ("1-rank overhead <= 3 % (CNN)", "overhead", "cnn", "ratio", 0.97),
    ("1-rank overhead <= 3 % (softmax)", "overhead", "softmax", "ratio", 0.97),
    ("softmax 2 ranks >= 3 x MWMS", "peer", "softmax", "ratio", 3.0),
]
ALLREDUCE_TARGET = ("all-reduce >= 0.8 x raw MPI from 1 MiB up", 0.8, 1 << 20)


@dataclasses.dataclass(frozen=True)
class Plan:
    quick: bool
    results_dir: str
    suites: tuple
    rounds: int

    def steps(self, model):
        return {("softmax", True): 300, ("softmax", False): 3000, ("cnn", True): 40, ("cnn", False): 300}[model, self.quick]

    @property
    def allreduce_sizes(self):
        top = 22 if self.quick else 26  # 4 MiB or 64 MiB
        return [1 << p for p in range(12, top + 1, 2)]


# --- launching ---------------------------------------------------------------------------------

def _env(threads, **extra):
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), **extra)


def _results(processes, timeout=900):
    """Wait for processes; collect the 'BENCH {json}' lines they printed."""
    found = []
    for p in processes:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args[:8])}... failed ({p.returncode}):\n{err[-3000:]}")
        found += [json.loads(line.split("BENCH ", 1)[1]) for line in out.splitlines() if "BENCH {" in line]
    return found


def _start(command, env):
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _worker(kind, *args):
    return [sys.executable, "-m", "hvd_sgd.bench", "worker", kind, *map(str, args)]


def hvd_sgd_throughput(np_, model, steps, extra=()):
    """hvd_sgd itself (python -m hvd_sgd.train), as a user runs it: its own img/s figure."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.json")
        train = [sys.executable, "-m", "hvd_sgd.train", "--model", model, "--batch-size", GLOBAL_BATCH[model] // np_,
                 "--max-steps", steps, "--test-examples", 1000, "--log-every-steps", 10 ** 6,
                 "--metrics-file", metrics, *extra]
        command = train if np_ == 1 else [str(_bin("horovodrun")), "-np", str(np_), *train]
        _results([_start(list(map(str, command)), _env(1))])
        with open(metrics) as f:
            return json.load(f)["images_per_second"]


def keras_throughput(model, batch, steps, threads, copies=1):
    """Plain Keras without Horovod; ``copies`` independent processes at once: their img/s each."""
    return [r["images_per_second"] for r in _results(
        [_start(_worker("keras", model, batch, steps, threads), _env(threads)) for _ in range(copies)])]


def mwms_throughput(model, global_batch, steps, workers, threads):
    ports = _free_ports(workers)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    processes = [_start(_worker("mwms", model, global_batch, steps, threads),
                        _env(threads, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})))
                 for i in range(workers)]
    return _results(processes)[0]["images_per_second"]


def allreduce_bandwidth(controller, sizes):
    """hvd.allreduce under the given controller; raw MPI (mpi4py, in processes without Horovod) beside the MPI one."""
    sizes = ",".join(map(str, sizes))
    mpirun = [shutil.which("mpirun"), "-np", "2"]
    launcher = mpirun if controller == "mpi" else [str(_bin("horovodrun")), "--gloo", "-np", "2"]
    result = _results([_start(launcher + _worker("allreduce", "horovod", sizes), _env(1))])[0]
    raw = _results([_start(mpirun + _worker("allreduce", "mpi4py", sizes), _env(1))])[0] if controller == "mpi" else {}
    return dict(sizes=result["sizes"], horovod=result["bandwidth"], mpi4py=raw.get("bandwidth", []),
                mpi4py_fixed_buffers=raw.get("bandwidth_fixed", []))


def time_to_accuracy(np_, plan):
    target = 0.95 if plan.quick else 0.99
    subset = ["--train-examples", 8000, "--test-examples", 2000, "--epochs", 3] if plan.quick else ["--epochs", 8]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.json")
        train = [sys.executable, "-m", "hvd_sgd.train", "--model", "cnn", "--batch-size", GLOBAL_BATCH["cnn"] // np_,
                 "--target-accuracy", target, "--metrics-file", metrics, *subset]
        command = train if np_ == 1 else [str(_bin("horovodrun")), "-np", str(np_), *train]
        started = time.perf_counter()
        _results([_start(list(map(str, command)), _env(1))], timeout=3600)
        seconds = time.perf_counter() - started
        with open(metrics) as f:
            m = json.load(f)
    return dict(target=target, seconds=seconds, accuracy=m["test_accuracy"], epochs=m["epochs"],
                reached=m["test_accuracy"] >= target)


def _bin(name):
    return os.path.join(os.path.dirname(sys.executable), name)


def _free_ports(n):
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]


# --- the suites ----------------------------------------------------------------------------------

def run_suites(plan):
    cores = os.cpu_count()
    results = dict(machine=dict(cores=cores, platform=platform.platform(), python=platform.python_version()),
                   quick=plan.quick, rounds=plan.rounds, suites={})
    for suite in plan.suites:
        print(f"== {suite}", flush=True)
        if suite == "allreduce":
            results["suites"][suite] = {c: allreduce_bandwidth(c, plan.allreduce_sizes) for c in ("mpi", "gloo")}
            continue
        if suite == "tta":
            results["suites"][suite] = {f"np{n}": time_to_accuracy(n, plan) for n in (1, 2)}
            continue
        rows = {}
        for model in MODELS:
            steps, batch = plan.steps(model), GLOBAL_BATCH[model]
            if suite == "overhead":
                contenders = dict(hvd_sgd_np1=lambda: hvd_sgd_throughput(1, model, steps),
                                  keras_np1=lambda: keras_throughput(model, batch, steps, cores)[0])
            elif suite == "scaling":
                contenders = dict(hvd_sgd_np2=lambda: hvd_sgd_throughput(2, model, steps), independent_2x1=lambda: sum(
                    keras_throughput(model, batch // 2, steps, max(1, cores // 2), copies=2)))
            elif suite == "peer":
                contenders = dict(hvd_sgd_np2=lambda: hvd_sgd_throughput(2, model, steps),
                                  mwms_np2=lambda: mwms_throughput(model, batch, steps, 2, max(1, cores // 2)))
            rows[model] = paired(contenders, plan.rounds)
            print(f"   {model}: {json.dumps(rows[model])}", flush=True)
        results["suites"][suite] = rows
    return results


def paired(contenders, rounds):
    """Measure two contenders back to back, ``rounds`` times, alternating which goes first.

    This machine's speed drifts by 20 % over minutes, so one pair of runs can mislead: the row
    holds each contender's median and the median of the per-round ratios (first / second), each
    ratio taken from two runs seconds apart."""
    first, second = contenders
    runs = {first: [], second: []}
    for i in range(rounds):
        for name in (first, second) if i % 2 == 0 else (second, first):
            runs[name].append(contenders[name]())
    ratios = [a / b for a, b in zip(runs[first], runs[second])]
    return {first: statistics.median(runs[first]), second: statistics.median(runs[second]),
            "ratio": statistics.median(ratios), "rounds": dict(runs, ratio=ratios)}


def _contenders(row):
    """The two contenders' names in a row made by ``paired``."""
    return [k for k in row if k not in ("ratio", "rounds")]


def verdicts(results):
    """PASS/MISS for every target whose suite ran: a miss is reported, never hidden."""
    lines = []
    for name, suite, model, key, minimum in TARGETS:
        row = results["suites"].get(suite, {}).get(model)
        if row:
            lines.append((name, row[key], minimum, row[key] >= minimum))
    if "allreduce" in results["suites"]:
        name, minimum, from_bytes = ALLREDUCE_TARGET
        mpi = results["suites"]["allreduce"]["mpi"]
        worst = min(h / m for size, h, m in zip(mpi["sizes"], mpi["horovod"], mpi["mpi4py"]) if size >= from_bytes)
        lines.append((name, worst, minimum, worst >= minimum))
    return lines


def write_report(results, directory):
    os.makedirs(directory, exist_ok=True)
    results["verdicts"] = [dict(target=n, measured=round(v, 3), minimum=m, passed=p) for n, v, m, p in verdicts(results)]
    with open(os.path.join(directory, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    md = [f"# hvd_sgd benchmark ({'quick' if results['quick'] else 'full'})", "",
          f"Machine: {results['machine']['cores']} cores, {results['machine']['platform']}. "
          f"Images per second are medians over {results['rounds']} round(s); a ratio is the median of per-round ratios.", ""]
    for suite, rows in results["suites"].items():
        md += [f"## {suite}", ""]
        if suite == "allreduce":
            md += ["Bus bandwidth, GB/s. Each all-reduce reduces the previous one's result; the last two columns "
                   "reduce one cache-warm send buffer over and over (textbook loop, shown, not the target).", "",
                   "| controller | size | hvd.allreduce | mpi4py Allreduce | ratio | mpi4py, fixed buffers | ratio |",
                   "| --- | --- | --- | --- | --- | --- | --- |"]
            for controller, r in rows.items():
                for i, size in enumerate(r["sizes"]):
                    ours = r["horovod"][i]
                    versus = " | ".join(f"{r[k][i]:.3f} | {ours / r[k][i]:.2f}" if r[k] else "— | —"
                                        for k in ("mpi4py", "mpi4py_fixed_buffers"))
                    md.append(f"| {controller} | {_size(size)} | {ours:.3f} | {versus} |")
        elif suite == "tta":
            md += ["| ranks | target | seconds | epochs | final accuracy |", "| --- | --- | --- | --- | --- |"]
            md += [f"| {k[2:]} | {r['target']} | {r['seconds']:.0f} | {r['epochs']:.2f} | {r['accuracy']:.4f} |" for k, r in rows.items()]
            if len(rows) == 2:
                md.append(f"\nSpeed-up np2 over np1: {rows['np1']['seconds'] / rows['np2']['seconds']:.2f}x")
        else:
            keys = _contenders(next(iter(rows.values())))
            md += [f"| model | {' img/s | '.join(keys)} img/s | ratio | per-round ratios |",
                   "| --- |" + " --- |" * (len(keys) + 2)]
            md += [f"| {m} | {' | '.join(f'{r[k]:.0f}' for k in keys)} | {r['ratio']:.2f} | "
                   f"{', '.join(f'{x:.2f}' for x in r['rounds']['ratio'])} |" for m, r in rows.items()]
        md.append("")
    md += ["## Targets", "", "| target | measured | needed | |", "| --- | --- | --- | --- |"]
    md += [f"| {v['target']} | {v['measured']} | {v['minimum']} | {'PASS' if v['passed'] else 'MISS'} |" for v in results["verdicts"]]
    with open(os.path.join(directory, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    _plot(results, directory)
    return "\n".join(md)


def _size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _plot(results, directory):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for suite in ("overhead", "scaling", "peer"):
        rows = results["suites"].get(suite)
        if not rows:
            continue
        fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows), 3.5))
        for ax, (model, row) in zip(list(getattr(axes, "flat", [axes])), rows.items()):
            keys = _contenders(row)
            ax.bar(keys, [row[k] for k in keys], color=["tab:blue", "tab:gray"])
            ax.set_title(f"{suite}: {model} (ratio {row['ratio']:.2f})")
            ax.set_ylabel("images / second")
        fig.tight_layout()
        fig.savefig(os.path.join(directory, f"{suite}.png"))
        plt.close(fig)
    if "scaling" in results["suites"]:
        rows = results["suites"]["scaling"]
        fig, ax = plt.subplots(figsize=(4.5, 3.5))
        ax.bar(list(rows), [r["ratio"] for r in rows.values()], color="tab:green")
        ax.axhline(0.9, color="red", linestyle="--", label="target 0.90")
        ax.set_ylabel("np2 / two independent processes")
        ax.set_title("scaling efficiency")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(directory, "scaling_efficiency.png"))
        plt.close(fig)
    if "allreduce" in results["suites"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for controller, r in results["suites"]["allreduce"].items():
            ax.plot(r["sizes"], r["horovod"], marker="o", label=f"hvd.allreduce ({controller} controller)")
            if r["mpi4py"]:
                ax.plot(r["sizes"], r["mpi4py"], marker="s", linestyle="--", label="mpi4py Allreduce (raw MPI)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.set_ylabel("bus bandwidth, GB/s")
        ax.set_title("all-reduce, 2 ranks")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(directory, "allreduce.png"))
        plt.close(fig)


# --- workers: what the contender processes run ----------------------------------------------------

def _step_timer(batch_size):
    """A Keras callback measuring images per second over all batches but the first."""
    import tensorflow as tf

    class StepTimer(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.start = time.perf_counter()
            self.last, self.batches = time.perf_counter(), batch

        def images_per_second(self):
            return self.batches * batch_size / (self.last - self.start)

    return StepTimer()


def _keras_setup(batch, steps, threads):
    """Threads, data and this worker's batches, as hvd_sgd would set them up for one rank."""
    import tensorflow as tf
    from hvd_sgd import data
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
    dataset = data.load("mnist")
    indices = data.rank_batch_indices(len(dataset.x_train), batch, 1, 0, 1, 0, steps)
    return dataset, indices


def keras_worker(model_name, batch, steps, threads):
    import tensorflow as tf
    from hvd_sgd import data, models
    dataset, indices = _keras_setup(batch, steps, threads)
    model = models.build(model_name, dataset.image_shape, 1)
    model.compile(tf.keras.optimizers.SGD(0.01, momentum=0.9),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = _step_timer(batch)
    model.fit(data.train_batches(dataset, indices), epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    print("BENCH " + json.dumps(dict(images_per_second=timer.images_per_second())), flush=True)


def mwms_worker(model_name, global_batch, steps, threads):
    import tensorflow as tf
    from hvd_sgd import data, models
    dataset, indices = _keras_setup(global_batch, steps, threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    batches = data.train_batches(dataset, indices).with_options(options)
    with strategy.scope():
        model = models.build(model_name, dataset.image_shape, 1)
        model.compile(tf.keras.optimizers.SGD(0.01, momentum=0.9),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = _step_timer(global_batch)
    model.fit(batches, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        print("BENCH " + json.dumps(dict(images_per_second=timer.images_per_second())), flush=True)


def allreduce_worker(library, sizes):
    """Bus bandwidth of a float32 sum all-reduce, per size: hvd.allreduce, or mpi4py's Allreduce.

    Both run the same chain, each all-reduce reducing the previous one's result (zeros, so the
    sums stay finite), as training reduces fresh gradients each step: hvd.allreduce in a compiled
    tf.function loop, as training runs it. mpi4py also reports the flattering textbook loop that
    reduces one send buffer over and over, which its cache keeps warm (``bandwidth_fixed``)."""
    import numpy as np
    sizes = [int(s) for s in str(sizes).split(",")]
    if library == "horovod":
        import tensorflow as tf
        from hvd_sgd import world
        w = world.start(threads_per_rank=1)
        import horovod.tensorflow as hvd
        size, is_chief = w.size, w.is_chief

        @tf.function
        def allreduce_chain(tensor, iterations):
            return tf.while_loop(lambda i, t: i < iterations, lambda i, t: (i + 1, hvd.allreduce(t, op=hvd.Sum)),
                                 (tf.constant(0), tensor))[1]

        def chain(nbytes):
            tensor = tf.zeros(nbytes // 4, tf.float32)
            return lambda iterations: allreduce_chain(tensor, tf.constant(iterations)).numpy()
        loops = dict(bandwidth=chain)
    else:
        from mpi4py import MPI
        size, is_chief = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank() == 0

        def mpi_chain(nbytes, fixed):
            """Each Allreduce reduces the previous result or, ``fixed``, the same send buffer every time."""
            buffers = [np.zeros(nbytes // 4, np.float32) for _ in range(2)]

            def run(iterations):
                for i in range(iterations):
                    source = 0 if fixed else i % 2
                    MPI.COMM_WORLD.Allreduce(buffers[source], buffers[1 - source])
            return run
        loops = dict(bandwidth=functools.partial(mpi_chain, fixed=False),
                     bandwidth_fixed=functools.partial(mpi_chain, fixed=True))

    result = dict(sizes=sizes)
    for key, make in loops.items():
        result[key] = []
        for nbytes in sizes:
            run, iterations = make(nbytes), max(5, min(200, (256 << 20) // nbytes))
            run(3)
            start = time.perf_counter()
            run(iterations)
            seconds = (time.perf_counter() - start) / iterations
            result[key].append(2 * (size - 1) / size * nbytes / seconds / 1e9)
    if is_chief:
        print("BENCH " + json.dumps(result), flush=True)


WORKERS = {"keras": keras_worker, "mwms": mwms_worker, "allreduce": allreduce_worker}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return WORKERS[argv[1]](*[int(a) if a.isdigit() else a for a in argv[2:]])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every suite small enough to finish in under 3 minutes")
    parser.add_argument("--results-dir", default="results/bench", help="where results.json, results.md and the PNG plots go")
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, from {','.join(SUITES)}")
    parser.add_argument("--rounds", type=int, help="times each pair of contenders runs, alternating (default 3; 1 with --quick)")
    args = parser.parse_args(argv)
    suites = tuple(args.suites.split(","))
    if not set(suites) <= set(SUITES):
        parser.error(f"--suites: unknown {sorted(set(suites) - set(SUITES))}")
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 3
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    plan = Plan(args.quick, args.results_dir, suites, rounds)
    started = time.perf_counter()
    results = run_suites(plan)
    results["seconds"] = time.perf_counter() - started
    results["command"] = "python -m hvd_sgd.bench " + " ".join(argv)
    print(write_report(results, plan.results_dir))
    print(f"\n({results['seconds']:.0f} s; results in {plan.results_dir})")


def cli():
    main()


if __name__ == "__main__":
    cli()
