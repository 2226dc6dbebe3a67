"""A/B, alternating in one job: hvd_sgd's loop with its sampled step times (on) and without (off).
The figures of "The step's times, sampled" in 2026-12-07-zen3.md (not a bench suite: it swaps the
loop's sampling rule in the running job).

    .venv/bin/mpirun -np 2 .venv/bin/python benchmarks/notes/2026-12-07-step-times-ab.py [EPOCHS] [BLOCK] [ON]

ON: "sampled" (hvd_sgd's rule, progress.sampled), "every" (every step notes its times) or "off" (an
A/A run: the noise).

Every BLOCK steps the job switches between on and off (ABBA order, the same step on every rank);
blocks with an evaluation are left out. Rank 0 prints each pair's ratio on/off of steps a second and
their median, and each kind of step's call time, by percentile."""
import statistics
import sys
import time

from hvd_sgd import config, train
from hvd_sgd.data import sources
from hvd_sgd.runtime import jobs
from hvd_sgd.training import loop, models, progress

args = sys.argv[1:] + ["4", "100", "sampled"][len(sys.argv) - 1:]
EPOCHS, BLOCK, ON = int(args[0]), int(args[1]), args[2]
RULES = dict(sampled=progress.sampled, every=lambda *_: True, off=lambda *_: False)
ORDER = (True, False, False, True)  # ABBA: a drift in the machine's speed cancels within four blocks

cfg = config.TrainConfig(epochs=EPOCHS)
job = jobs.start(cfg.ranks)
data = sources.load(cfg.data, job.world)
blocks, started = [], [None]  # (on, steps a second, evaluated)


def after_step(n):
    if n % BLOCK:
        return
    now = time.perf_counter()
    if started[0] is not None:
        on = ORDER[(n // BLOCK - 1) % 4]
        evaluated = (n - 1) // loop_plan[0] != (n - BLOCK) // loop_plan[0] or n // BLOCK == 1
        blocks.append((on, BLOCK / (now - started[0]), evaluated))
    on_next = ORDER[(n // BLOCK) % 4]
    loop.sampled = RULES[ON] if on_next else RULES['off']
    started[0] = time.perf_counter()


loop_plan = [None]
real_run = loop.Trainer.run


def run(trainer, after=None):
    loop_plan[0] = trainer.plan.steps_per_epoch
    loop.sampled = RULES[ON] if ORDER[0] else RULES['off']
    return real_run(trainer, after_step)


loop.Trainer.run = run
durations = {True: [], False: []}  # each counted step's call, by whether it noted its times
real_step_done = progress.StepClock.step_done


def step_done(clock, images, called, ended, graph_times=None, counted=True):
    if counted:
        durations[graph_times is not None].append(ended - called)
    return real_step_done(clock, images, called, ended, graph_times, counted)


progress.StepClock.step_done = step_done
train.fit(models.cnn, data, cfg, job)
if job.world.is_chief:
    pairs = []
    for i in range(0, len(blocks) - 1, 2):
        a, b = blocks[i], blocks[i + 1]
        if a[2] or b[2]:
            continue
        on, off = (a, b) if a[0] else (b, a)
        pairs.append(on[1] / off[1])
    print(f"A/B {ON}/off: {len(pairs)} pairs of {BLOCK}-step blocks; on/off median {statistics.median(pairs):.4f}, "
          f"mean {statistics.mean(pairs):.4f}, quartiles {statistics.quantiles(pairs, n=4)}")
    for q in (10, 25, 50) if durations[True] else ():  # an A/A run has no step that notes its times
        sampled_q, plain_q = (statistics.quantiles(durations[k], n=100)[q - 1] for k in (True, False))
        print(f"a step's call, percentile {q}: noting its times {sampled_q * 1e3:.3f} ms ({len(durations[True])} steps), "
              f"not {plain_q * 1e3:.3f} ms ({len(durations[False])}): {sampled_q / plain_q:.4f}")
    print("pairs", " ".join(f"{p:.3f}" for p in pairs))
