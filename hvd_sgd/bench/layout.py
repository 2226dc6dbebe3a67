"""Ranks per node, chosen by measurement.

N ranks train exactly like one rank with N x the batch, so how a node is split (ranks x threads per
rank) changes the speed and nothing else. Each layout here trains the same global batch: the run's
own, as run/train lays it out (one rank per core, --batch-size each), cut into per-rank batches
of global / ranks, with the learning rate per rank scaled to keep the same peak rate; hvd_sgd gives
each rank its share of the node's cores, and as many threads. With the linear scaling rule (the
default) the warm-up starts from one rank's rate, the peak over the ranks, so its first steps
differ by layout; with --no-lr-scaling the weights are the same in every layout.

    python -m hvd_sgd.bench.layout [hvd_sgd.train flags]    each layout's speed, and the fastest's commands
    python -m hvd_sgd.bench.layout --choose [flags]         the fastest's ranks and flags (run/train, NP=auto)
"""
import statistics
import sys

from hvd_sgd import config
from hvd_sgd.bench import contenders
from hvd_sgd.training.plan import global_batch, scaled_lr

# Long enough to pass start-up's first steps and time a few seconds of the built-in models.
STEPS = {"softmax": 300, "mlp": 200, "cnn": 60, "classic_cnn": 20, "resnet20": 10, "resnet50": 3}
USERS_MODEL_STEPS = 20


def layouts(cores):
    """Each way to split ``cores``: (ranks, threads per rank), as many ranks as divide the cores."""
    return [(ranks, cores // ranks) for ranks in range(1, cores + 1) if cores % ranks == 0]


def flags_for(argv, ranks, cores):
    """``argv`` with the per-rank batch and learning rate of ``ranks`` ranks: the global batch and
    the peak learning rate of one rank per core, run/train's layout (the rate is for the global
    batch already under --no-lr-scaling)."""
    cfg = config.parse(config.TrainConfig, list(argv))
    share = cores // ranks
    return [*argv, "--batch-size", str(global_batch(cfg.batch_size, share)),
            "--lr", repr(scaled_lr(cfg.lr, share, cfg.lr_scaling))]


def measure(argv, rounds=1, steps=None, cores=None):
    """Each layout's images a second for the run ``argv`` describes, over ``steps`` steps a round,
    the layouts' order alternating round by round: {(ranks, threads): [img/s, ...]}."""
    cores = cores or contenders.CORES
    model = config.parse(config.TrainConfig, list(argv)).model
    steps = steps or STEPS.get(model, USERS_MODEL_STEPS)
    runs = {layout: [] for layout in layouts(cores)}
    for i in range(rounds):
        for ranks, threads in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            timed = [*flags_for(argv, ranks, cores), "--max-steps", str(steps), "--test-examples", "500",
                     "--log-every-steps", str(10 ** 6)]
            runs[ranks, threads].append(contenders.layout_throughput(ranks, timed))
    return runs


def fastest(runs):
    return max(runs, key=lambda layout: statistics.median(runs[layout]))


def commands(ranks, threads, argv):
    """How to launch ``ranks`` ranks of ``threads`` cores a node: each launcher's line."""
    flags = " ".join(flags_for(argv, ranks, ranks * threads)[len(argv):])
    train = f"python -m hvd_sgd.train {' '.join(argv)} {flags}".replace("  ", " ").strip()
    return [f"mpirun -np {ranks} --bind-to none {train}",
            f"horovodrun -np {ranks} {train}",
            f"NP={ranks} run/train {' '.join(argv)} {flags}".strip(),
            f"sbatch --ntasks-per-node={ranks} --cpus-per-task={threads} run/slurm/train.sbatch {' '.join(argv)} {flags}"
            .strip()]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    choose = argv[:1] == ["--choose"]
    argv = argv[1:] if choose else argv
    runs = measure(argv)
    best = fastest(runs)
    for (ranks, threads), rates in runs.items():
        mark = "  <- fastest" if (ranks, threads) == best else ""
        print(f"[hvd_sgd] {ranks} rank(s) x {threads} thread(s): {statistics.median(rates):.0f} img/s{mark}",
              file=sys.stderr)
    if choose:  # run/train reads: the ranks, then the flags, each NUL-terminated
        sys.stdout.write("".join(f"{word}\0" for word in [str(best[0]), *flags_for(argv, best[0], contenders.CORES)]))
    else:
        print("\n".join(commands(*best, argv)))


if __name__ == "__main__":
    main()
