"""End-to-end: real launchers, real processes, real Horovod, small MNIST subsets."""
import json
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import (PYTHON, ROOT, STACK, assert_same_weights, error_lines, launch, max_difference, output_lines,
                      read_json, reported_accuracy, saved_weights, succeeded, train_and_save)
from hvd_sgd.bench import launchers


@pytest.mark.slow
@pytest.mark.both_stacks
@pytest.mark.parametrize("launcher,np_", [("python", 1), ("mpirun", 2), ("horovodrun", 2), ("horovodrun-gloo", 2)])
def test_every_launcher_trains_with_one_summary_of_all_its_ranks(launcher, np_, tmp_path, tiny_run):
    metrics = tmp_path / "metrics.json"
    result = succeeded(launch(launcher, np_, "--model", "softmax", "--lr", "0.1", "--max-steps", 40,
                              "--metrics-file", metrics, *tiny_run))
    accuracy = reported_accuracy(result)
    summary = read_json(metrics)
    assert summary["world_size"] == np_ and summary["steps"] == 40 and summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-4)
    assert accuracy > 0.75  # 40 steps of softmax regression on MNIST
    assert len(summary["weight_checksums"]) == np_
    assert summary["images_per_second"] > 0 and summary["versions"]["horovod"] == "0.28.1"
    assert sum(line.startswith("Test accuracy") for line in output_lines(result.stdout)) == 1  # rank 0 alone


def test_throughput_counts_the_training_steps_only(monkeypatch):
    """Not a compiled step's first call (it traces), nor evaluations, nor what happens after the last step."""
    from hvd_sgd.training import progress
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.StepClock()
    clock.start(0)
    for seconds, counted in ((5.0, False), (1.5, True), (4.0, False), (1.5, True)):  # each graph's first call
        now[0] += seconds
        clock.step_done(100, now[0] - 1, now[0], counted=counted)
    with clock.paused():
        now[0] += 30.0  # an evaluation
    now[0] += 0.5
    clock.step_done(100, now[0] - 0.5, now[0])
    now[0] += 60.0  # tearing down the input pipeline, writing the model
    assert clock.images_per_second() == 3 * 100 / 3.5
    assert clock.wall_seconds() == 102.5


def test_a_steps_parts_are_the_sampled_steps_times_and_the_loops_is_between_every_two_steps():
    """input, compute, all-reduce from the sampled steps' own times; the loop's from every step's
    return to the next call, and from a sampled call to its graph's start, but not across a pause (an
    evaluation is not the loop's)."""
    from hvd_sgd.training import progress
    clock = progress.StepClock()
    clock.start(0)
    clock.step_done(64, 0.0, 5.2, (0.0, 0.1, 5.0), counted=False)  # the first call traces: not counted
    clock.step_done(64, 5.3, 5.85, (5.3, 5.35, 5.75))
    clock.step_done(64, 5.95, 6.45)  # not sampled: its gap before counts, its parts are not known
    clock.step_done(64, 6.55, 7.0, (6.6, 6.7, 6.8))
    np.testing.assert_allclose(clock.take_parts(), [0.075, 0.25, 0.15, 0.125])  # seconds a step
    with clock.paused():
        pass
    clock.step_done(64, 100.0, 100.6, (100.0, 100.1, 100.5))
    np.testing.assert_allclose(clock.take_parts(), [0.1, 0.4, 0.1, 0.0])
    np.testing.assert_allclose(clock.take_parts(), [0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("log_every", [50, 200, 16, 7, 1])
def test_one_step_in_ten_is_sampled_and_every_whole_interval_has_five(log_every):
    from hvd_sgd.training import progress
    total = 1234
    steps = [n for n in range(1, total + 1) if progress.sampled(n, log_every, total)]
    intervals = [range(start + 1, min(start + log_every, total) + 1) for start in range(0, total, log_every)]
    assert all(sum(n in interval for n in steps) >= min(len(interval), progress.MIN_SAMPLES)
               for interval in intervals[:-1])
    assert steps[-1] == total  # the last, partial interval has one too
    if log_every >= 50:
        assert len(steps) <= total // progress.SAMPLE_EVERY_STEPS + len(intervals)
    if log_every == 50:
        assert steps[:13] == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130]


PLACEMENT = r"""
import json, os, sys
from hvd_sgd.runtime import startup
w = startup.start(threads_per_rank=int(sys.argv[2]), bind_cpus=sys.argv[1] == "bind")
def affinity(thread):
    try:
        return tuple(sorted(os.sched_getaffinity(int(thread))))
    except ProcessLookupError:  # the thread ended since the listing
        return None
threads = {affinity(t) for t in os.listdir("/proc/self/task")} - {None}
sys.stdout.write("PLACEMENT " + json.dumps(dict(rank=w.rank, threads=w.threads, cpus=sorted(os.sched_getaffinity(0)),
                                                same_for_all_threads=len(threads) == 1,
                                                cycle_ms=os.environ["HOROVOD_CYCLE_TIME"])) + "\n")  # one write per line
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher,bind,threads", [("horovodrun", True, 0), ("horovodrun", True, 1),
                                                  ("horovodrun", False, 0), ("mpirun", True, 0),
                                                  ("horovodrun-gloo", True, 0)])
def test_each_rank_gets_its_own_share_of_the_cores(launcher, bind, threads, tmp_path):
    """horovodrun leaves ranks unbound: hvd_sgd binds each (all its threads) to its own slice,
    unless --no-bind-cpus, whatever --threads-per-rank says; mpirun's own binding is kept. Under
    Gloo the ranks stay unbound (its TCP thread must not wait behind the compute), with a share's
    threads."""
    (tmp_path / "placement.py").write_text(PLACEMENT)
    result = succeeded(launch(launcher, 2, "bind" if bind else "no", threads, module="placement", env={"PYTHONPATH": str(tmp_path)}))
    ranks = sorted(map(json.loads, re.findall(r"PLACEMENT (\{[^{}]*\})", result.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    machine = sorted(os.sched_getaffinity(0))
    assert all(r["cycle_ms"] == ("0" if len(machine) >= 2 else "0.1") for r in ranks), ranks
    if bind and launcher != "horovodrun-gloo":
        assert set(ranks[0]["cpus"]).isdisjoint(ranks[1]["cpus"]), ranks
        assert all(r["same_for_all_threads"] and r["threads"] == (threads or len(r["cpus"])) >= 1 for r in ranks), ranks
    else:
        assert all(r["cpus"] == machine and r["threads"] == max(1, len(machine) // 2) for r in ranks), ranks


@pytest.mark.parametrize("env,expected", [
    ({}, "1"),  # one rank: Horovod's default
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "0"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "0.1"),  # more ranks than cores
    ({"HOROVOD_SIZE": "8", "HOROVOD_LOCAL_SIZE": "2"}, "0"),  # 2 per node on 4 nodes
    ({"SLURM_NTASKS": "4"}, "0.1"),  # placement unknown: as if all on this node
])
def test_horovod_cycle_is_zero_while_every_rank_has_a_core(env, expected, monkeypatch):
    from hvd_sgd.runtime import announced, startup
    for name in {*announced.SIZE_VARIABLES, *announced.LOCAL_SIZE_VARIABLES}:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(startup.os, "cpu_count", lambda: 2)
    assert startup._cycle_time_ms() == expected


IDLE_CPU = """
import json, resource, time
import tensorflow as tf
from hvd_sgd.runtime import startup
startup.start()
import horovod.tensorflow as hvd
hvd.allreduce(tf.ones(4))  # the background thread has worked, and now has nothing to do
before = resource.getrusage(resource.RUSAGE_SELF)
time.sleep(2)
after = resource.getrusage(resource.RUSAGE_SELF)
busy = hvd.allgather_object((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / 2)  # and wakes up
if hvd.rank() == 0:  # one line: unbuffered, two ranks' prints can interleave word by word (seen in CI)
    print(json.dumps(busy))
"""


@pytest.mark.slow
def test_horovods_thread_takes_no_cpu_while_its_rank_has_nothing_to_reduce():
    """At hvd_sgd's 0 ms cycle, Horovod 0.28.1's background thread negotiated without pause: a
    whole core while its rank waited, 13-19 % of it while training softmax. Patched
    (run/patches/), it waits for a tensor instead (docs/design.md)."""
    result = succeeded(subprocess.run([launchers.mpirun(), "-np", "2", PYTHON, "-c", IDLE_CPU],
                                      env=launchers.environment(), cwd=ROOT, capture_output=True, text=True,
                                      timeout=120))
    busy = json.loads(output_lines(result.stdout)[-1])
    assert len(busy) == 2 and max(busy) < 0.2, busy


FAULTS_PER_ALLREDUCE = """
import resource, statistics
import tensorflow as tf
from hvd_sgd.runtime import startup
startup.start()
import horovod.tensorflow as hvd
tensor = tf.zeros(16 << 20)  # 64 MiB
for _ in range(4):  # the allocator warmed up: how many outputs live at once depends on the threads' timing
    tensor = hvd.allreduce(tensor, op=hvd.Sum)
faults = []
for _ in range(8):  # the median: under load an output now and then takes a fresh region
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor = hvd.allreduce(tensor, op=hvd.Sum)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults))
"""


@pytest.mark.slow
@pytest.mark.parametrize("onednn,allocator,most", [(None, None, 1024), ("0", None, 1024), ("0", "false", None)])
def test_a_large_all_reduce_reuses_its_output_memory(onednn, allocator, most):
    """TensorFlow's default CPU allocator faults 16k fresh pages in for each 64 MiB output. oneDNN's
    (hvd_sgd turns oneDNN on) keeps them, and so does BFC, which hvd_sgd sets for oneDNN off (the
    user's TF_ENABLE_ONEDNN_OPTS and TF_CPU_ALLOCATOR_USE_BFC win)."""
    chosen = {"TF_ENABLE_ONEDNN_OPTS": onednn, "TF_CPU_ALLOCATOR_USE_BFC": allocator}
    env = {k: v for k, v in launchers.environment().items() if k not in chosen}
    env.update({k: v for k, v in chosen.items() if v})
    result = subprocess.run([PYTHON, "-c", FAULTS_PER_ALLREDUCE], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    faults = float(result.stdout.split()[-1])
    assert faults < most if most else faults > (64 << 20) // 4096 // 2, faults


@pytest.mark.slow
@pytest.mark.both_stacks
@pytest.mark.parametrize("model", ["softmax", "mlp"])
def test_n_ranks_with_batch_b_train_like_one_rank_with_batch_nb(model, tmp_path):
    """The heart of the product: synchronous averaging makes the number of ranks invisible."""
    common = ["--model", model, "--lr", "0.05", "--no-lr-scaling", "--momentum", "0.9", "--train-examples", 640,
              "--test-examples", 500, "--max-steps", 30, "--seed", 7]  # 20 steps per epoch: crosses an epoch
    one = train_and_save(tmp_path, "np1", "python", 1, *common, "--batch-size", 32)
    two = train_and_save(tmp_path, "np2", "mpirun", 2, *common, "--batch-size", 16)
    assert_same_weights(one, two, rtol=1e-4, atol=1e-5)
    if model == "softmax":  # the comparison can fail: one rank with batch B is a different run
        other = train_and_save(tmp_path, "np1-small", "python", 1, *common, "--batch-size", 16)
        assert max_difference(one, other) > 1e-3


# Each of hvd_sgd's flags that is a prefix of one of horovodrun's options, which horovodrun's parser read
# as its own before the launcher patch (--timeline, a prefix of two, ended the job "ambiguous option"),
# and what the program says of it under horovodrun: proof that the flag reached the program.
REACHES_THE_PROGRAM = {
    "--elastic": (["--elastic"], "--elastic needs horovodrun's elastic mode"),
    "--timeline": (["--timeline", "t.json", "--timeline-steps", "500:600"], "--timeline-steps 500:600: the run has"),
    "--help": (["--help"], "usage: python -m hvd_sgd.train"),
}


@pytest.mark.slow
def test_every_flag_that_is_a_prefix_of_a_horovodrun_option_reaches_the_program(tmp_path, tiny_run):
    def run(command):
        return subprocess.run(list(map(str, command)), cwd=tmp_path, env=launchers.environment(), capture_output=True,
                              text=True, timeout=120)
    theirs = set(re.findall(r"--[\w-]+", run([launchers.venv_bin("horovodrun"), "--help"]).stdout))
    ours = set(re.findall(r"^  (?:-\w, )?(--[\w-]+)", run([PYTHON, "-m", "hvd_sgd.train", "--help"]).stdout, re.MULTILINE))
    assert len(theirs) > 40 and len(ours) > 40, (theirs, ours)
    assert {flag for flag in ours if any(option.startswith(flag) for option in theirs)} == set(REACHES_THE_PROGRAM)
    for flag, (args, said) in REACHES_THE_PROGRAM.items():
        result = run(launchers.command("horovodrun", 2, "hvd_sgd.train", [*args, "--max-steps", 2, *tiny_run]))
        assert said in result.stdout + result.stderr and "horovodrun: error" not in result.stderr, \
            (flag, result.stderr[-2000:])


# --- gradient accumulation and fp16 all-reduce -------------------------------------------------

ACCUMULATION = ["--model", "mlp", "--train-examples", 640, "--test-examples", 500, "--max-steps", 30, "--seed", 5,
                "--warmup-epochs", 0]


@pytest.mark.slow
@pytest.mark.both_stacks
def test_accumulation_trains_like_a_larger_batch_and_scales_the_rate_with_it(tmp_path):
    """2 ranks x 2 backward passes of 8 is one rank with batch 32: with --lr x scaled by ranks x
    passes (4x), and unscaled. A step is one update: 30 steps of 32 cross an epoch of 20."""
    metrics = tmp_path / "m.json"
    scaled = train_and_save(tmp_path, "scaled", "mpirun", 2, *ACCUMULATION, "--batch-size", 8,
                            "--backward-passes-per-step", 2, "--lr", "0.05", "--metrics-file", metrics)
    summary = read_json(metrics)
    assert (summary["steps"], summary["epochs"], summary["global_batch"], summary["learning_rate"]) == (30, 1.5, 32, 0.2)
    assert_same_weights(scaled, train_and_save(tmp_path, "lr4x", "python", 1, *ACCUMULATION, "--batch-size", 32,
                                               "--lr", "0.2", "--no-lr-scaling"), rtol=1e-4, atol=1e-5)
    unscaled = train_and_save(tmp_path, "unscaled", "mpirun", 2, *ACCUMULATION, "--batch-size", 8,
                              "--backward-passes-per-step", 2, "--lr", "0.05", "--no-lr-scaling")
    same_rate = train_and_save(tmp_path, "lr1x", "python", 1, *ACCUMULATION, "--batch-size", 32, "--lr", "0.05",
                               "--no-lr-scaling")
    assert_same_weights(unscaled, same_rate, rtol=1e-4, atol=1e-5)
    # The control: summing the two passes instead of averaging them would train at twice the rate.
    twice_the_rate = train_and_save(tmp_path, "lr2x", "python", 1, *ACCUMULATION, "--batch-size", 32, "--lr", "0.1",
                                    "--no-lr-scaling")
    assert max_difference(same_rate, twice_the_rate) > 1e-3


@pytest.mark.slow
@pytest.mark.both_stacks
def test_fp16_allreduce_sends_half_precision_and_keeps_the_accuracy(tmp_path):
    common = ["--model", "mlp", "--train-examples", 4096, "--test-examples", 2000, "--max-steps", 100,
              "--batch-size", 32, "--lr", "0.02"]
    results = {}
    for name, extra in (("fp32", []), ("fp16", ["--fp16-allreduce"])):
        metrics = tmp_path / f"{name}.json"
        weights = train_and_save(tmp_path, name, "mpirun", 2, *common, *extra, "--metrics-file", metrics)
        results[name] = weights, read_json(metrics)
    (fp32, fp32_summary), (fp16, fp16_summary) = results["fp32"], results["fp16"]
    assert abs(fp16_summary["test_accuracy"] - fp32_summary["test_accuracy"]) <= 0.005
    # Gradients rounded to float16 on the wire: the weights drift by more than float32 rounding, but little.
    assert 1e-5 < max_difference(fp32, fp16) < 0.05, max_difference(fp32, fp16)


@pytest.mark.slow
@pytest.mark.both_stacks
def test_resume_continues_and_ends_where_an_uninterrupted_run_ends(tmp_path):
    """With gradient accumulation (without it: the reliability tests' resumes after a kill)."""
    common = ["--model", "mlp", "--lr", "0.02", "--train-examples", 1024, "--test-examples", 500,
              "--batch-size", 16, "--backward-passes-per-step", 2]
    straight = train_and_save(tmp_path, "straight", "mpirun", 2, *common, "--max-steps", 30)
    checkpoints = tmp_path / "checkpoints"
    succeeded(launch("mpirun", 2, *common, "--max-steps", 12, "--checkpoint-dir", checkpoints))
    assert (checkpoints / "checkpoint").exists()
    metrics = tmp_path / "resumed.json"
    resumed = train_and_save(tmp_path, "resumed", "mpirun", 2, *common, "--max-steps", 30,
                             "--checkpoint-dir", checkpoints, "--resume", "--metrics-file", metrics)
    assert read_json(metrics)["steps"] == 30
    assert_same_weights(straight, resumed)


@pytest.mark.slow
def test_resume_on_another_number_of_ranks_needs_the_same_global_batch(tmp_path):
    """2 ranks x 16 checkpointed, resumed on 1 rank: refused with batch 16, exact with batch 32."""
    common = ["--model", "mlp", "--lr", "0.04", "--no-lr-scaling", "--train-examples", 1024, "--test-examples", 500]
    straight = train_and_save(tmp_path, "straight", "mpirun", 2, *common, "--batch-size", 16, "--max-steps", 30)
    checkpoints = tmp_path / "checkpoints"
    succeeded(launch("mpirun", 2, *common, "--batch-size", 16, "--max-steps", 12, "--checkpoint-dir", checkpoints))
    refused = launch("python", 1, *common, "--batch-size", 16, "--max-steps", 30, "--checkpoint-dir", checkpoints,
                     "--resume")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    [line] = error_lines(refused)
    assert "trained with a global batch of 32 examples a step, this run has 16" in line, line
    resumed = train_and_save(tmp_path, "resumed", "python", 1, *common, "--batch-size", 32, "--max-steps", 30,
                             "--checkpoint-dir", checkpoints, "--resume")
    assert_same_weights(straight, resumed, rtol=1e-4, atol=1e-5)


@pytest.mark.both_stacks
@pytest.mark.slow
def test_run_train_learns_and_the_saved_model_loads_with_plain_tensorflow(tmp_path):
    """The README's command (its set-up is done: seconds), on 2 ranks, on a quarter of MNIST."""
    model_path, metrics = tmp_path / "cnn.keras", tmp_path / "cnn.json"
    result = succeeded(subprocess.run(list(map(str, [
        ROOT / "run" / "train", "--train-examples", 16000, "--test-examples", 2000, "--save-model", model_path,
        "--metrics-file", metrics, "--log-dir", tmp_path / "tb"])),
        env=launchers.environment(NP="2", HVD_SGD_STACK=STACK),
        capture_output=True, text=True, timeout=600))
    accuracy = reported_accuracy(result)
    assert accuracy >= 0.97 and read_json(metrics)["world_size"] == 2, accuracy
    assert list((tmp_path / "tb").iterdir())  # TensorBoard event file
    # A fresh process with nothing but TensorFlow (and its numpy) reproduces the accuracy.
    check = subprocess.run([PYTHON, "-c", """
import sys, numpy as np, tensorflow as tf
test = np.load(sys.argv[1])
x, y = test["x_test"][:2000, ..., None] / 255.0, test["y_test"][:2000]
model = tf.keras.models.load_model(sys.argv[2])
print(model.evaluate(x, y, verbose=0)[1])
assert "hvd_sgd" not in sys.modules and "horovod" not in sys.modules
""", str(mnist_cache()), str(model_path)], capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert float(check.stdout.split()[-1]) == pytest.approx(accuracy, abs=1e-4)


def mnist_cache():
    from hvd_sgd.data import datasets
    datasets.load("mnist")
    return f"{datasets.data_dir()}/mnist.npz"


def test_the_recipe_runs_in_this_process_on_one_rank(tmp_path):
    """The quick tier's run of the whole recipe: hvd_sgd.train.main in the test's own process, one
    rank, a few steps, its summary written (the launchers and several ranks are the slow tier's)."""
    from hvd_sgd import train
    metrics = tmp_path / "m.json"
    train.main(list(map(str, ["--model", "softmax", "--train-examples", 512, "--test-examples", 200,
                              "--batch-size", 64, "--max-steps", 4, "--metrics-file", metrics])))
    summary = read_json(metrics)
    assert summary["steps"] == 4 and summary["world_size"] == 1 and summary["test_examples"] == 200, summary
    assert 0 < summary["test_accuracy"] <= 1 and summary["images_per_second"] > 0


# A model whose initial weights depend on the rank that builds it, as a model seeded from the
# process (its id, the clock, the rank) would: only the start-up broadcast makes the ranks agree.
RANK_SEEDED = """
import os
import tensorflow as tf

def model(input_shape, num_classes):
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
    seed = rank if os.environ.get("SEED_FROM_RANK") == "1" else 0
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(num_classes, kernel_initializer=tf.keras.initializers.RandomNormal(seed=seed))])
"""


@pytest.mark.slow
def test_every_rank_starts_from_rank_0s_broadcast_variables(tmp_path, monkeypatch):
    """Each rank builds different initial weights; after the start-up broadcast they train exactly as
    ranks that all built rank 0's (hvd_sgd also checks the ranks agree right after the broadcast)."""
    (tmp_path / "rank_seeded.py").write_text(RANK_SEEDED)
    monkeypatch.syspath_prepend(tmp_path)
    import rank_seeded
    monkeypatch.setenv("SEED_FROM_RANK", "1")
    built = []
    for rank in ("0", "1"):  # without the broadcast the ranks would start apart
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
        built.append(rank_seeded.model((28, 28, 1), 10).get_weights())
    assert max_difference(*built) > 0.1
    run = ["--model", "rank_seeded:model", "--train-examples", 1024, "--test-examples", 200, "--max-steps", 8]
    weights = {}
    for seeded in ("1", "0"):
        path = tmp_path / f"seeded-{seeded}.keras"
        succeeded(launch("mpirun", 2, *run, "--save-model", path,
                         env=dict(PYTHONPATH=str(tmp_path), SEED_FROM_RANK=seeded)))
        weights[seeded] = saved_weights(path)
    assert_same_weights(weights["1"], weights["0"], rtol=0, atol=0)
