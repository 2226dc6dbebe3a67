"""The suites: which contenders meet, how often, and in what order."""
import dataclasses
import json
import os
import platform
import statistics
import sys

from hvd_sgd.bench import launchers
from hvd_sgd.bench import contenders, decomposition, layout

SUITES = ("overhead", "scaling", "peer", "allreduce", "tta", "lever", "stacks", "network", "project", "input",
          "precision", "layout")
# lever: without and with one environment variable; stacks: needs the keras2 stack set up too;
# network: root and a virtual cluster (run/cluster); project: network's results; input: image files;
# precision: float32 against mixed_bfloat16; layout: ranks x threads a node (bench.layout), for --models
# (a user's package.module:function too) and --data-dir.
DEFAULT_SUITES = SUITES[:5]
# The lever suite's, unless --lever names another: Open MPI's shared-memory transport then copies
# messages through its shared segment instead of process to process (CMA), a lever left to the user.
DEFAULT_LEVER = "OMPI_MCA_btl_vader_single_copy_mechanism=none"
STACKS = ("current", "keras2")
MODELS = ("softmax", "classic_cnn", "cnn")  # quick: the first two (the targets' models)
# Each paired suite: hvd_sgd first, the contender it is measured against second (ratio = first / second).
PAIRS = {
    "overhead": (contenders.hvd_sgd_np1, contenders.keras_np1),
    "scaling": (contenders.hvd_sgd_np2, contenders.independent_2x1),
    "peer": (contenders.hvd_sgd_np2, contenders.mwms_np2),
}
TTA_CONTENDERS = ("hvd_sgd_np1", "hvd_sgd_np2", "keras")
# Steps a run, by (model, quick): quick runs check that a suite runs, and CI runs them (minutes of its budget).
STEPS = {("softmax", True): 100, ("softmax", False): 3000, ("classic_cnn", True): 10, ("classic_cnn", False): 300,
         ("cnn", True): 12, ("cnn", False): 1000, ("resnet20", True): 10, ("resnet20", False): 100}


@dataclasses.dataclass(frozen=True)
class Plan:
    quick: bool
    results_dir: str
    suites: tuple
    rounds: int
    models: tuple  # the paired suites' (overhead, scaling, peer, lever, stacks, network)
    links: tuple = ()  # the network suite's, from network.LINKS
    lever: str = DEFAULT_LEVER  # the lever suite's NAME=VALUE
    data_dir: str = None  # the layout suite's

    @property
    def allreduce_sizes(self):
        powers = (12, 16, 20, 22) if self.quick else range(12, 27, 2)  # 4 KiB to 4 MiB, or to 64 MiB
        return [1 << p for p in powers]

    @property
    def decomposition_blocks(self):
        """Blocks of each step in a decomposition: enough for the median of their ratios to hold
        still while the machine's speed drifts; quick runs check that it runs."""
        return 2 if self.quick else 6

    @property
    def allreduce_blocks(self):
        """Timed blocks a size, each loop: enough to hold the ratio hvd / mpi4py steady from run to run,
        where a third of them did not; quick runs check that it runs."""
        return 3 if self.quick else 15


def default_models(quick):
    return MODELS[:2] if quick else MODELS


def run(plan):
    results = dict(machine=dict(cores=os.cpu_count(), platform=platform.platform(), python=platform.python_version()),
                   quick=plan.quick, rounds=plan.rounds, suites={})
    for suite in plan.suites:
        print(f"== {suite}", flush=True)
        if suite == "allreduce":
            results["suites"][suite] = {
                controller: contenders.allreduce_bandwidth(controller, plan.allreduce_sizes, plan.rounds,
                                                           plan.allreduce_blocks)
                for controller in ("mpi", "gloo")}
        elif suite == "network":
            from hvd_sgd.bench import network
            steps = {m: STEPS[m, plan.quick] for m in plan.models}
            results["suites"][suite] = network.run(plan, paired, steps, plan.models)
        elif suite == "project":
            from hvd_sgd.bench import network, project
            measured = results["suites"]["network"]
            models = {m for row in measured.values() for m in network.model_rows(row)}
            results["suites"][suite] = project.run(measured, project.model_sizes(models))
        elif suite == "stacks":
            results["suites"][suite] = stacks(plan)
        elif suite == "lever":
            results["suites"][suite] = lever(plan)
        elif suite == "input":
            results["suites"][suite] = input_suite(plan)
        elif suite == "precision":
            results["suites"][suite] = precision_suite(plan)
        elif suite == "layout":
            results["suites"][suite] = layout_suite(plan)
        elif suite == "tta":
            results["suites"][suite] = {c: contenders.time_to_accuracy(c, plan.quick) for c in TTA_CONTENDERS}
        else:
            rows = {}
            for model in plan.models:
                rows[model] = paired(PAIRS[suite], model, STEPS[model, plan.quick], plan.rounds)
                if suite == "scaling":  # where 2 ranks' step goes, against the ceiling's
                    rows[model]["decomposition"] = decomposition.row(
                        contenders.decomposed(model, STEPS[model, plan.quick], plan.decomposition_blocks))
                print(f"   {model}: {json.dumps(rows[model])}", flush=True)
            results["suites"][suite] = rows
    return results


# The input suite's sets: (model, pixels square, colour) on MNIST's first examples (quick: fewer).
INPUT_SETS = (("classic_cnn", 64, True), ("cnn", 28, False))
INPUT_EXAMPLES = {True: (512, 200), False: (8192, 10000)}  # (train, test) by quick
EVALUATION_REPEATS = {True: 1, False: 5}  # by quick
EVALUATION_SOURCES = {True: ("folder",), False: ("memory", "folder")}  # quick: the streamed one


def input_suite(plan):
    """The same model and images fed from memory (an .npz), from JPEG image folders and from JPEG
    TFRecord shards, hvd_sgd on 2 ranks, the three alternating round by round; how many images a
    second one decode call and all cores' read and decode from the folders; an evaluation of the
    test set by rank 0 alone and by both ranks, from memory and from the folders (quick: the
    folders); then the default recipe on the arrays against the same images as a JPEG folder tree
    (input_recipe)."""
    import tempfile
    rows, (examples, test_examples) = {}, INPUT_EXAMPLES[plan.quick]
    for model, size, colour in INPUT_SETS[:1] if plan.quick else INPUT_SETS:
        with tempfile.TemporaryDirectory() as directory:
            contenders.input_sets(directory, examples, test_examples, size, colour)
            sources = {"memory": "memory.npz", "folder": "folder", "tfrecord": "tfrecord"}
            runs = {name: [] for name in sources}
            for i in range(plan.rounds):
                for name in (list(sources) if i % 2 == 0 else list(sources)[::-1]):
                    runs[name].append(contenders.streamed_throughput(os.path.join(directory, sources[name]),
                                                                     examples, model, STEPS[model, plan.quick]))
            decode = {threads: contenders.decode_rate(directory, threads) for threads in sorted({1, contenders.CORES})}
            evaluation = {name: contenders.evaluation_seconds(os.path.join(directory, sources[name]), model,
                                                              EVALUATION_REPEATS[plan.quick])
                          for name in EVALUATION_SOURCES[plan.quick]}
        rows[f"{model} {size}x{size}{'x3' if colour else ''}"] = dict(
            **{name: statistics.median(values) for name, values in runs.items()},
            **{f"{name}_over_memory": statistics.median(s / m for s, m in zip(runs[name], runs["memory"]))
               for name in ("folder", "tfrecord")},
            decode_per_second={str(t): rate for t, rate in decode.items()}, rounds=runs, evaluation=evaluation)
        print(f"   {model}: {json.dumps(rows[next(reversed(rows))], default=str)[:300]}", flush=True)
    return dict(sets=rows, recipe=input_recipe(plan))


def input_recipe(plan):
    """The default recipe on 2 ranks, 3 seeds, on Fashion-MNIST's arrays and on the same images
    written as a JPEG folder tree (python -m hvd_sgd.data export); quick: a subset of MNIST, 1 seed."""
    import subprocess
    import tempfile
    dataset, subset = ("mnist", ["--train-examples", 1024, "--test-examples", 500]) if plan.quick \
        else ("fashion_mnist", [])
    runs = {"arrays": [], "folder": []}
    with tempfile.TemporaryDirectory() as directory:
        folder = os.path.join(directory, "folder")
        subprocess.run(list(map(str, [sys.executable, "-m", "hvd_sgd.data", "export", "--format", "folder",
                                      "--from", dataset, *subset, folder])), check=True, stdout=subprocess.DEVNULL)
        epochs = ["--epochs", 1] if plan.quick else []
        for seed in (1,) if plan.quick else (1, 2, 3):
            for name, data in (("arrays", ["--dataset", dataset, *subset]), ("folder", ["--data-dir", folder])):
                metrics, launched, ended = contenders.recipe(2, *data, *epochs, "--seed", seed)
                runs[name].append(dict(seed=seed, accuracy=metrics["test_accuracy"], seconds=ended - launched))
            print(f"   {dataset} seed {seed}: {[r[-1]['accuracy'] for r in runs.values()]}", flush=True)
    return dict(dataset=dataset, runs=runs)


def layout_suite(plan):
    """Each model's speed in each layout of this machine (bench.layout), the fastest, and its commands."""
    rows = {}
    for model in plan.models:
        argv = ["--model", model, *(["--data-dir", plan.data_dir] if plan.data_dir else [])]
        runs = layout.measure(argv, plan.rounds)
        best = layout.fastest(runs)
        top = statistics.median(runs[best])
        rows[model] = dict(layouts=[dict(ranks=r, threads=t, images_per_second=statistics.median(v),
                                         of_fastest=statistics.median(v) / top, rounds=v) for (r, t), v in runs.items()],
                           fastest=dict(ranks=best[0], threads=best[1]), commands=layout.commands(*best, argv))
        print(f"   {model}: fastest {best[0]} x {best[1]}", flush=True)
    return rows


PRECISION_MODELS = ("cnn", "classic_cnn", "resnet20")
PRECISIONS = ("float32", "mixed_bfloat16")
# mixed_float16 against float32 on 2 ranks, the default model: steps a run (quick, full). Without float16
# arithmetic a step takes tens of times float32's, so fewer steps.
FLOAT16_STEPS = {True: 4, False: 40}


def precision_suite(plan):
    """float32 against mixed_bfloat16: each model's throughput on 1 and 2 ranks, the two alternating
    round by round; float32 against mixed_float16 (what hvd_sgd refuses on a CPU without float16
    arithmetic unless forced), the default model on 2 ranks; then the default recipe's accuracy on
    MNIST and Fashion-MNIST in each (3 seeds; with --quick 1, on a subset of MNIST), with its time to
    0.99 on MNIST; and the CPU's 16-bit features. --quick, CI's check that it runs: 2 ranks only."""
    flags = set(open("/proc/cpuinfo").read().split())
    rows = dict(cpu=sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16", "avx512f",
                                    "avx2"}), throughput={}, recipe={})
    runs = {"float32": [], "mixed_float16": []}
    for i in range(plan.rounds):
        for p in (runs if i % 2 == 0 else list(runs)[::-1]):
            runs[p].append(contenders.hvd_sgd_throughput(2, "cnn", FLOAT16_STEPS[plan.quick],
                                                         extra=("--precision", p, "--force-precision")))
    rows["float16"] = dict(**{p: statistics.median(v) for p, v in runs.items()}, rounds=runs,
                           slowdown=statistics.median(f / h for f, h in zip(runs["float32"], runs["mixed_float16"])))
    print(f"   cnn np2 float32 / mixed_float16: {rows['float16']['slowdown']:.1f}", flush=True)
    for model in PRECISION_MODELS[:1] if plan.quick else PRECISION_MODELS:
        for np_ in (2,) if plan.quick else (1, 2):
            runs = {p: [] for p in PRECISIONS}
            for i in range(plan.rounds):
                for p in (PRECISIONS if i % 2 == 0 else PRECISIONS[::-1]):
                    runs[p].append(contenders.hvd_sgd_throughput(np_, model, STEPS[model, plan.quick],
                                                                 extra=("--precision", p, "--force-precision")))
            rows["throughput"][f"{model} np{np_}"] = dict(
                **{p: statistics.median(v) for p, v in runs.items()},
                ratio=statistics.median(b / f for b, f in zip(runs["mixed_bfloat16"], runs["float32"])), rounds=runs)
            print(f"   {model} np{np_}: {rows['throughput'][f'{model} np{np_}']['ratio']:.2f}", flush=True)
    subset = ["--train-examples", 1024, "--test-examples", 500, "--epochs", 1] if plan.quick else []
    for dataset in ("mnist",) if plan.quick else ("mnist", "fashion_mnist"):  # quick: CI's check that it runs
        for p in PRECISIONS:
            runs = []
            for seed in (1,) if plan.quick else (1, 2, 3):
                metrics, launched, _ = contenders.recipe(2, "--dataset", dataset, "--precision", p, "--force-precision",
                                                         "--seed", seed, *subset)
                reached = next((e for e in metrics["evaluations"] if e["accuracy"] >= 0.99), None)
                runs.append(dict(seed=seed, accuracy=metrics["test_accuracy"],
                                 to_99=reached and reached["time"] - launched))
            rows["recipe"][f"{dataset} {p}"] = runs
            print(f"   {dataset} {p}: {[r['accuracy'] for r in runs]}", flush=True)
    return rows


def stack_python(stack):
    """The Python of a stack's installation (run/lib.sh): .venv, .venv-keras2 beside it."""
    prefix = sys.prefix.removesuffix("-keras2")
    return os.path.join(prefix + ("-keras2" if stack == "keras2" else ""), "bin", "python")


def stacks(plan):
    """The overhead and scaling suites on each stack (docs/guide.md, "Two stacks"), one after the other
    for each model; then the current stack's hvd_sgd throughput over the keras2 stack's, at 1 and 2 ranks."""
    rows = {}
    for model in plan.models:
        rows[model] = {}
        for stack in STACKS:
            with launchers.using_python(stack_python(stack)):
                rows[model][stack] = {suite: paired(PAIRS[suite], model, STEPS[model, plan.quick], plan.rounds)
                                      for suite in ("overhead", "scaling")}
        by_stack = rows[model]
        rows[model]["current_over_keras2"] = {
            f"np{n}": by_stack["current"][suite][name] / by_stack["keras2"][suite][name]
            for n, suite, name in ((1, "overhead", "hvd_sgd_np1"), (2, "scaling", "hvd_sgd_np2"))}
        print(f"   {model}: {json.dumps(rows[model]['current_over_keras2'])}", flush=True)
    return rows


def lever(plan):
    """The scaling suite and the MPI controller's all-reduce without and with the environment
    variable ``plan.lever`` (NAME=VALUE), the two settings alternating round by round: what a lever
    buys, side by side in one run. Every round's figure is kept; the report takes medians."""
    name, value = plan.lever.split("=", 1)
    settings = {"without": None, "with": value}
    scaling = {setting: {model: [] for model in plan.models} for setting in settings}  # ratios, a round each
    allreduce = {setting: [] for setting in settings}  # hvd.allreduce's GB/s and ratio to mpi4py by size, a round each
    for _ in range(plan.rounds):
        for setting, setting_value in settings.items():
            with launchers.environment_variable(name, setting_value):
                for model in plan.models:
                    row = paired(PAIRS["scaling"], model, STEPS[model, plan.quick], 1)
                    scaling[setting][model].append(row["ratio"])
                run = contenders.allreduce_bandwidth("mpi", plan.allreduce_sizes, 1, plan.allreduce_blocks)
                allreduce[setting].append(dict(horovod=run["horovod"], ratio=[r[0] for r in run["ratios"]]))
        print(f"   scaling ratios: {json.dumps(scaling)}", flush=True)

    def by_size(setting, key):  # each size's figures over the rounds
        return [list(values) for values in zip(*(run[key] for run in allreduce[setting]))]
    return dict(variable=name, value=value,
                scaling={model: {setting: scaling[setting][model] for setting in settings} for model in plan.models},
                allreduce=dict(sizes=plan.allreduce_sizes,
                               horovod={setting: by_size(setting, "horovod") for setting in settings},
                               horovod_over_mpi4py={setting: by_size(setting, "ratio") for setting in settings}))


def paired(pair, model, steps, rounds):
    """Measure two contenders back to back, ``rounds`` times, alternating which goes first.

    This machine's speed drifts by 20 % over minutes, so one pair of runs can mislead: the row
    holds each contender's median and the median of the per-round ratios (first / second), each
    ratio taken from two runs seconds apart."""
    runs = {contender.__name__: [] for contender in pair}
    for contender in contenders.alternating(pair, rounds):
        runs[contender.__name__].append(contender(model, steps))
    first, second = runs.values()
    ratios = [a / b for a, b in zip(first, second)]
    return {**{name: statistics.median(values) for name, values in runs.items()},
            "ratio": statistics.median(ratios), "rounds": dict(runs, ratio=ratios)}


def contender_names(row):
    """The two contenders' names in a row made by ``paired``."""
    return [k for k in row if k not in ("ratio", "rounds", "decomposition")]
