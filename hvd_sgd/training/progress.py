"""Where a run's time goes, while it runs: the step clock, and every --log-every-steps interval
the progress line, TensorBoard's scalars, the metrics series and the slow-rank line.

The loop notes when it calls each step and when the call returns. A sampled step (``sampled``) also
notes three times in its compiled graph (``GRAPH_TIMES``): its start, its batch ready, its gradients
all computed. Between them a step is input, compute, and the all-reduce (with the wait for the
slowest rank, and the update after it) up to its return; between one step's return and the next
call, and from a call to its graph's start, is hvd_sgd's own loop. The ranks share their figures once
an interval, in the all-gather that averages the loss: every rank then holds every rank's, and rank
0 reports them.
"""
import contextlib
import math
import resource
import socket
import time

import numpy as np

from hvd_sgd import JobError

PARTS = ("input", "compute", "allreduce", "loop")  # a step's parts
GRAPH_TIMES = ("start", "input_ready", "computed")  # a sampled step's, noted by its compiled graph
# One step in this many is sampled: the graph's times cost a sampled step more than the whole run may
# spend on them (docs/design.md, "Where a run's time goes"). A shorter interval samples more often, so
# that its figures, and the slow-rank rule, still rest on MIN_SAMPLES steps.
SAMPLE_EVERY_STEPS = 10
MIN_SAMPLES = 5
SLOW_RANK_REPEAT_SECONDS = 60  # while a rank stays slow, its line again at most this often
# A rank is named only if the others' wait for it is also this share of a step at least: on a step of
# a few ms, a lag of a fraction of a ms is the machine's noise, and costs the job nothing to speak of.
SLOW_RANK_MIN_STEP_SHARE = 0.1


def sampled(step, log_every_steps, total_steps):
    """Whether global ``step`` notes its parts' times: one in SAMPLE_EVERY_STEPS (more often in an
    interval shorter than MIN_SAMPLES of those), and an interval's last."""
    every = max(1, min(SAMPLE_EVERY_STEPS, log_every_steps // MIN_SAMPLES))
    return step % every == 0 or step % log_every_steps == 0 or step == total_steps


class StepClock:
    """Training throughput, progress times, and where this rank's steps spent their time.

    Throughput counts every step but a compiled step's first call (which traces and optimizes its
    graph), and leaves out what runs inside ``paused()``: evaluations, checkpoints, which are not
    the loop's part either."""

    def __init__(self):
        self.created = time.perf_counter()
        self.images, self.seconds, self.counted_steps = 0, 0.0, 0
        self.last = self.first_step_at = None
        self.first_step = self.steps = 0
        self._take()
        self.last_end = None

    def start(self, step):
        """A (re)start of the loop at global ``step``."""
        self.last, self.first_step, self.steps, self.last_end = None, step, 0, None
        self.started = time.perf_counter()

    def step_done(self, images, called, ended, graph_times=None, counted=True):
        """A step of ``images`` examples over all ranks, called and returned at ``called`` and ``ended``
        (time.time()); ``graph_times``: a sampled step's GRAPH_TIMES (seconds, the same clock);
        ``counted``: False for a compiled step's first call, which traces and optimizes its graph."""
        now = time.perf_counter()
        self.first_step_at = self.first_step_at or ended
        if counted and self.last is not None:
            self.images += images
            self.seconds += now - self.last
            self.counted_steps += 1
            if self.last_end is not None:
                self.between += called - self.last_end
                self.between_steps += 1
            if graph_times is not None:
                start, input_ready, computed = graph_times
                self.parts += (input_ready - start, computed - input_ready, ended - computed, start - called)
                self.sampled_steps += 1
        self.last, self.last_end = now, ended
        self.steps += 1

    @contextlib.contextmanager
    def paused(self):
        yield
        self.last, self.last_end = time.perf_counter(), None

    def take_parts(self):
        """Seconds a step in each part since the last call (zeros before the first counted step): the
        sampled steps' parts, and the loop's between every two steps."""
        parts = self.parts / max(1, self.sampled_steps)
        parts[-1] += self.between / max(1, self.between_steps)
        self._take()
        return parts

    def _take(self):
        self.parts, self.sampled_steps, self.between, self.between_steps = np.zeros(len(PARTS)), 0, 0.0, 0

    def images_per_second(self):
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def seconds_per_step(self):
        """The mean of the timed steps; 0 before the first."""
        return self.seconds / self.counted_steps if self.counted_steps else 0.0

    def wall_seconds(self):
        return time.perf_counter() - self.created

    def eta(self, step, total_steps):
        """Seconds left at the pace of this loop so far, evaluations included."""
        return (time.perf_counter() - self.started) / max(1, self.steps) * (total_steps - step)


class Progress:
    """The interval report of a loop on the ranks of the moment (a collective: every rank calls it)."""

    def __init__(self, world, plan, clock, outputs, slow_rank_lag):
        import horovod.tensorflow as hvd
        self.world, self.plan, self.clock, self.outputs, self.slow_rank_lag = world, plan, clock, outputs, slow_rank_lag
        self.hosts = hvd.allgather_object(socket.gethostname())
        self.slow_named_at, self.slow_before = -math.inf, None

    def report(self, step, loss, learning_rate, check_finite):
        """Every rank's figures of the interval ending at global ``step``, gathered; the loss averaged
        over the ranks (checked finite if ``check_finite``: the same on every rank); rank 0 reports."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        mine = [float(loss), *self.clock.take_parts(), _peak_memory_mb()]
        every = hvd.allgather(tf.constant([mine], tf.float64), name="progress").numpy()  # [ranks, 1 + parts + 1]
        loss, parts, memory = float(every[:, 0].mean()), every[:, 1:1 + len(PARTS)], every[:, -1]
        if check_finite:
            finite(loss, "loss", step)
        shares = (parts / np.maximum(parts.sum(axis=1, keepdims=True), 1e-12)).mean(axis=0)
        rate, eta = self.clock.images_per_second(), self.clock.eta(step, self.plan.total_steps)
        self.world.log(f"step {step}/{self.plan.total_steps}  epoch {self.plan.epoch(step):.2f}  loss {loss:.4f}  "
                       f"lr {learning_rate:.4g}  {rate:.0f} img/s  "
                       f"elapsed {_minutes(self.clock.wall_seconds())}  ETA {_minutes(eta)}  "
                       + " ".join(f"{name} {share:.0%}" for name, share in zip(PARTS, shares))
                       + f"  peak {memory.max():.0f} MB")
        slowest, lag = self._slowest(parts)
        self.outputs.scalars(step, {"train/loss": loss, "train/images_per_second": rate,
                                    "train/learning_rate": learning_rate, "memory/peak_mb": memory.max(),
                                    **{f"time/{name}": share for name, share in zip(PARTS, shares)}})
        self.outputs.interval(dict(
            step=step, epoch=self.plan.epoch(step), loss=loss, learning_rate=learning_rate, images_per_second=rate,
            slowest_rank=slowest, slowest_lag=lag,
            ranks=[dict(rank=r, host=self.hosts[r], **{f"{name}_seconds": parts[r, i] for i, name in enumerate(PARTS)},
                        peak_memory_mb=memory[r]) for r in range(len(every))]))
        return loss

    def _slowest(self, parts):
        """The rank whose input and compute took longest a step, and its lag on the median of the
        other ranks (every rank waits for it in each all-reduce); the line naming it, when the lag
        passes --slow-rank-lag in two intervals running (one interval's few sampled steps can catch
        a rank that lost its core once), at most once a SLOW_RANK_REPEAT_SECONDS while it lasts."""
        busy = parts[:, 0] + parts[:, 1]
        if len(busy) < 2:
            return None, 0.0
        slowest = int(busy.argmax())
        median = float(np.median(np.delete(busy, slowest)))
        if median <= 0:
            return None, 0.0
        lag = float(busy[slowest] / median - 1)
        costly = busy[slowest] - median >= SLOW_RANK_MIN_STEP_SHARE * parts.sum(axis=1).mean()
        over = bool(self.slow_rank_lag) and lag > self.slow_rank_lag and costly
        again, self.slow_before = over and self.slow_before == slowest, slowest if over else None
        if again and time.monotonic() - self.slow_named_at >= SLOW_RANK_REPEAT_SECONDS:
            self.slow_named_at = time.monotonic()
            self.world.log(f"hvd_sgd: rank {slowest} ({self.hosts[slowest]}) is slow: {busy[slowest] * 1e3:.1f} ms a "
                           f"step of input and compute against the other ranks' median {median * 1e3:.1f} ms (+{lag:.0%}); "
                           f"every rank waits for it in each all-reduce")
        return slowest, lag


def _peak_memory_mb():
    """This process's peak resident memory (Linux counts it in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def finite(value, what, step):
    """Divergence check. Every rank sees the same value (an all-reduced loss, or identical
    weights), so every rank stops at the same step, and the last checkpoint stays the last good one."""
    if not math.isfinite(value):
        raise JobError(f"the {what} is {value} at step {step}: training diverged (try a lower --lr); "
                       f"no checkpoint was written from this step on")
    return value


def _minutes(seconds):
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
