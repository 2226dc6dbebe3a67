"""The operator's view (docs/guide.md, "Watching a run"): where each interval's time goes, the slow
rank named, Horovod's timeline for a window of steps, and no precision trap on a CPU."""
import collections
import json
import os
import re
import signal
import types

import numpy as np
import pytest

from conftest import (LONG_RUN, checkpoint_from_step, ended_within, error_lines, launch, output_lines, read_json,
                      start_and_wait, succeeded)
from hvd_sgd import JobError, config
from hvd_sgd.bench import launchers
from hvd_sgd.runtime.cli import EXIT_STOPPED
from hvd_sgd.training import precision

SHORT = ["--model", "mlp", "--train-examples", 4096, "--test-examples", 500, "--epochs", 1]


def series(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def slow_rank_lines(result):
    return [line for line in output_lines(result.stdout) if " is slow: " in line]


@pytest.mark.slow
def test_each_interval_says_where_its_time_went(tmp_path):
    metrics = tmp_path / "metrics.json"
    result = succeeded(launch("mpirun", 2, "--train-examples", 16384, "--test-examples", 500, "--epochs", 1,
                              "--log-every-steps", 64, "--metrics-file", metrics))
    lines = [line for line in output_lines(result.stdout) if line.startswith("step ")]
    assert len(lines) == 4 and all(re.search(r"input \d+% compute \d+% allreduce \d+% loop \d+%  peak \d+ MB$", line)
                                   for line in lines), lines
    intervals = series(tmp_path / "metrics.jsonl")
    assert [i["step"] for i in intervals] == [64, 128, 192, 256] and read_json(metrics)["steps"] == 256
    for interval in intervals:
        assert [r["rank"] for r in interval["ranks"]] == [0, 1]
        for rank in interval["ranks"]:
            assert rank["compute_seconds"] > 0 and rank["peak_memory_mb"] > 100
            assert all(rank[f"{part}_seconds"] >= 0 for part in ("input", "allreduce", "loop"))


SLOW_RANK = """
import os, time
import tensorflow as tf


def _slower(batch):
    time.sleep(float(os.environ["SLOWER_SECONDS"]) if os.environ.get("OMPI_COMM_WORLD_RANK") == "1" else 0)
    return batch


class SlowerOnRank1(tf.keras.layers.Layer):
    def call(self, x):
        y = tf.py_function(_slower, [x], x.dtype)
        y.set_shape(x.shape)
        return y


def model(input_shape, num_classes):
    return tf.keras.Sequential([tf.keras.Input(input_shape), tf.keras.layers.Flatten(), SlowerOnRank1(),
                                tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(num_classes)])
"""


@pytest.mark.slow
@pytest.mark.parametrize("slower_seconds", [0.0, 0.1])
def test_a_slow_rank_is_named_once_with_its_host_and_an_even_run_names_none(tmp_path, slower_seconds):
    """Rank 1's forward pass sleeps ``slower_seconds`` a step (a slow node): far more than any noise.
    The even run's ranks share one core, so that the suite's other jobs, on this machine's cores, slow
    both alike: a rank whose core another job takes is slow, and would be named."""
    (tmp_path / "slow_rank.py").write_text(SLOW_RANK)
    result = succeeded(launch("mpirun", 2, "--model", "slow_rank:model", "--train-examples", 4096,
                              "--test-examples", 500, "--epochs", 1, "--log-every-steps", 16,
                              "--metrics-file", tmp_path / "metrics.json", timeout=300,
                              wrapper=() if slower_seconds else ("taskset", "-c", "0"),
                              env=dict(PYTHONPATH=str(tmp_path), SLOWER_SECONDS=str(slower_seconds))))
    named, later = slow_rank_lines(result), series(tmp_path / "metrics.jsonl")[1:]  # the first interval starts up
    if not slower_seconds:
        assert not named, (named, later)
        return
    [line] = named  # once: the run is shorter than a minute's repeat
    assert line.startswith(f"hvd_sgd: rank 1 ({os.uname().nodename}) is slow: ") and "median" in line, line
    assert all(i["slowest_rank"] == 1 and i["slowest_lag"] > 1 for i in later), later


def negotiations_per_tensor(path):
    """How many times each tensor was all-reduced in a timeline (Horovod gives each tensor a row)."""
    with open(path) as f:
        events = json.load(f)  # the file is valid JSON as it is
    return collections.Counter(e["pid"] for e in events if e.get("name") == "NEGOTIATE_ALLREDUCE")


@pytest.mark.slow
def test_the_timeline_records_its_window_only(tmp_path):
    """Each gradient is all-reduced once a step: the most all-reduced tensors were so in the window's
    steps alone, not in the 60 others (the stop check's all-reduce comes less often). Under horovodrun,
    as the README launches it (its parser once took --timeline for its own, ambiguous, options)."""
    timeline = tmp_path / "timeline.json"
    succeeded(launch("horovodrun", 2, *SHORT, "--max-steps", 70, "--timeline", timeline, "--timeline-steps", "11:17"))
    counts = negotiations_per_tensor(timeline)
    assert max(counts.values()) == 7 and sum(1 for c in counts.values() if c == 7) >= 2, counts


@pytest.mark.slow
def test_the_timeline_is_valid_json_after_a_stop_on_sigint(tmp_path):
    timeline, checkpoints = tmp_path / "timeline.json", tmp_path / "ckpt"
    run = start_and_wait(launchers.command("mpirun", 2, "hvd_sgd.train", [
        *LONG_RUN, "--max-steps", 100000, "--checkpoint-dir", checkpoints, "--timeline", timeline,
        "--timeline-steps", "2:100000"]), checkpoint_from_step(checkpoints, 50), timeout=120)
    run.send_signal(signal.SIGINT)
    status, stdout, stderr = ended_within(run, 60)
    assert status == EXIT_STOPPED, stderr[-2000:]
    [line] = [line for line in output_lines(stderr) if "stopped on" in line]
    stopped_at = int(line.split(" at step ")[1].split("/")[0])
    assert max(negotiations_per_tensor(timeline).values()) == stopped_at - 1  # steps 2 to the stop


@pytest.mark.parametrize("steps", ["5:3", "0:3", "x", "3", "1:x"])
def test_a_reversed_or_malformed_timeline_window_is_one_line(steps):
    with pytest.raises(JobError, match=f"--timeline-steps {steps}: FIRST:LAST, two steps with 1 <= FIRST <= LAST"):
        config.parse(config.TrainConfig, ["--timeline", "t.json", "--timeline-steps", steps])


@pytest.mark.slow
def test_a_timeline_window_after_the_run_is_one_line(tmp_path):
    result = launch("mpirun", 2, *SHORT, "--timeline", tmp_path / "t.json", "--timeline-steps", "500:600", timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    [line] = error_lines(result)
    assert line.endswith("--timeline-steps 500:600: the run has 64 steps"), line


@pytest.mark.slow
def test_an_unwritable_timeline_is_one_line_before_training(tmp_path):
    result = launch("mpirun", 2, *SHORT, "--timeline", "/proc/no/timeline.json", timeout=120)
    [line] = error_lines(result)
    assert "--timeline /proc/no/timeline.json: cannot create" in line, line
    assert not any(line.startswith("step ") for line in output_lines(result.stdout))


def checked(precision_flag, flags, device="CPU", force=False):
    """What precision.check does: its JobError's text, or its hint, or None."""
    said = []
    numerics = types.SimpleNamespace(precision=precision_flag, force_precision=force)
    try:
        precision.check(numerics, device, set(flags), said.append)
    except JobError as e:
        return f"error: {e}"
    return said[0] if said else None


ZEN4 = ("avx2", "avx512f", "avx512_bf16")  # no float16 arithmetic
SAPPHIRE_RAPIDS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
ZEN3 = ("avx2",)


@pytest.mark.parametrize("flags,expected", [(ZEN4, "error"), (ZEN3, "error"), (SAPPHIRE_RAPIDS, None)])
def test_float16_is_refused_on_a_cpu_without_its_arithmetic(flags, expected):
    said = checked("mixed_float16", flags)
    assert (said or "").startswith(expected or "") and (said is None) == (expected is None), said
    if said:
        assert "slower than float32" in said and "--force-precision" in said
        assert ("mixed_bfloat16" in said) == ("avx512_bf16" in flags), said
    assert checked("mixed_float16", flags, force=True) is None
    assert checked("mixed_float16", flags, device="GPU /physical_device:GPU:0") is None


@pytest.mark.parametrize("flags,hinted", [(ZEN4, True), (SAPPHIRE_RAPIDS, True), (ZEN3, False)])
def test_float32_gets_a_hint_where_the_cpu_computes_bfloat16(flags, hinted):
    said = checked("float32", flags)
    assert (said is not None) == hinted, said
    if hinted:
        assert said.startswith("hint: ") and "--precision mixed_bfloat16" in said and "as fast as float32" in said


@pytest.mark.parametrize("flags,refused", [(ZEN4, False), (SAPPHIRE_RAPIDS, False), (ZEN3, True)])
def test_bfloat16_is_refused_on_a_cpu_without_its_arithmetic(flags, refused):
    said = checked("mixed_bfloat16", flags)
    assert (said is not None) == refused, said
    if refused:
        assert said.startswith("error: --precision mixed_bfloat16: this CPU has no bfloat16 arithmetic")
        assert "slower than float32" in said and "use float32, or add --force-precision" in said, said
    assert checked("mixed_bfloat16", flags, force=True) is None
    assert checked("mixed_bfloat16", flags, device="GPU /physical_device:GPU:0") is None


@pytest.mark.slow
def test_this_cpus_flags_decide_end_to_end(tmp_path):
    """The rule on this machine's own flags: each 16-bit precision refused (or trained, where the CPU has
    its arithmetic), float32 hinted where it computes bfloat16."""
    flags = precision.cpu_flags()
    for chosen, native in precision.NATIVE.items():
        run = launch("mpirun", 2, *SHORT, "--max-steps", 5, "--precision", chosen, timeout=180)
        if flags & set(native):
            succeeded(run)
            continue
        [line] = error_lines(run)
        assert f"no {chosen.removeprefix('mixed_')} arithmetic" in line and "Traceback" not in run.stderr, line
        if chosen == "mixed_float16":  # forced, it trains (mixed_bfloat16's semantics: test_precision.py)
            succeeded(launch("mpirun", 2, *SHORT, "--max-steps", 5, "--precision", chosen, "--force-precision",
                             timeout=300))
    float32 = succeeded(launch("mpirun", 2, *SHORT, "--max-steps", 5, timeout=180))
    hints = [line for line in output_lines(float32.stdout) if line.startswith("hint: ")]
    assert len(hints) == (1 if flags & set(precision.NATIVE["mixed_bfloat16"]) else 0), hints


def named_slowest(busy_ms, step_ms=None, lag=1.0):
    """progress.Progress's slow-rank rule on ranks whose input and compute took ``busy_ms`` a step."""
    from hvd_sgd.training import progress
    said = []
    report = object.__new__(progress.Progress)
    report.world, report.hosts = types.SimpleNamespace(log=said.append), [f"node{r}" for r in range(len(busy_ms))]
    report.slow_rank_lag, report.slow_named_at, report.slow_before = lag, -float("inf"), None
    busy = np.array(busy_ms, float) / 1e3
    wait = (max(busy_ms) if step_ms is None else step_ms) / 1e3 - busy
    parts = np.stack([np.zeros_like(busy), busy, wait, np.zeros_like(busy)], axis=1)
    report._slowest(parts)
    assert not said, "named after one interval"
    slowest, measured = report._slowest(parts)  # the same lag in the next interval
    return slowest, round(measured, 2), said


def test_the_slowest_rank_is_named_against_the_others_median_two_intervals_running_once_a_minute():
    assert named_slowest([10, 10, 10, 31])[:2] == (3, 2.1)
    assert "rank 3 (node3) is slow: 31.0 ms" in named_slowest([10, 10, 10, 31])[2][0]
    assert named_slowest([10, 10, 10, 19])[2] == []  # under twice the others'
    assert named_slowest([0.3, 0.3, 0.9], step_ms=15)[2] == []  # twice, but 0.6 ms of a 15 ms step
    assert named_slowest([10, 10, 10, 19], lag=0.5)[2] != [] and named_slowest([10, 40], lag=0)[2] == []
    from hvd_sgd.training import progress
    report_twice = object.__new__(progress.Progress)
    said = []
    report_twice.world, report_twice.hosts, report_twice.slow_rank_lag = types.SimpleNamespace(log=said.append), \
        ["a", "b"], 1.0
    report_twice.slow_named_at, report_twice.slow_before = -float("inf"), None
    parts, even = np.array([[0, 0.010, 0.030, 0], [0, 0.040, 0, 0]]), np.array([[0, 0.010, 0, 0], [0, 0.010, 0, 0]])
    for interval in (parts, even, parts, parts, parts):  # slow once, even, then slow three times running
        report_twice._slowest(interval)
    assert len(said) == 1  # the second of the three; within the minute, not again
