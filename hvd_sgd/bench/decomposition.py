"""Where a step's time goes: the parts of hvd_sgd's step on every rank, against the ceiling's.

From each rank's timestamps of each step (workers.decompose): the batch gathered and the forward
and backward passes (compute), the all-reduce cut into the wait for the slowest rank (how much
later than this rank the last one arrived) and the transfer, the update, and the rest (Python
between steps). The parts add up to the step, step by step; the ceiling (two processes with no
all-reduce, at once) has compute, update and rest only, and the gap between the two is what 2 ranks
lose: more compute (cores and caches shared with the other rank's Horovod thread and MPI), the
wait, the transfer, the rest.
"""
import numpy as np

PARTS = ("compute", "wait", "allreduce", "update", "rest")


def parts(report):
    """The mean of each part over the steps and ranks of one job's report, in milliseconds, and its
    step (the time from one step's start to the next's)."""
    times = [np.array(r["times"]) for r in report["ranks"]]
    n = min(len(t) for t in times)
    start, computed, reduced, end = np.stack([t[:n] for t in times]).transpose(2, 0, 1)  # each [ranks, steps]
    one_host = len({r["host"] for r in report["ranks"]}) == 1
    # One host: one clock, so the last rank's arrival at the all-reduce is known; across hosts the
    # spread of the ranks' compute times stands for it.
    arrival = computed if one_host else computed - start
    wait = np.minimum(arrival.max(axis=0) - arrival, reduced - computed)
    measured = dict(compute=computed - start, wait=wait, allreduce=reduced - computed - wait, update=end - reduced,
                    rest=np.concatenate([start[:, 1:] - end[:, :-1], np.zeros((len(start), 1))], axis=1))
    step = np.diff(start, axis=1)
    result = {k: float(v[:, :-1].mean()) * 1e3 for k, v in measured.items()}
    result["step"] = float(step.mean()) * 1e3
    return result


def row(together, alone):
    """The two jobs' parts and the gap: 2 ranks' step over the ceiling's (the efficiency they imply,
    per-rank batch the same) and each part's share of the difference."""
    ranks, ceiling = parts(together), [parts(report) for report in alone]
    ceiling = {k: float(np.mean([c[k] for c in ceiling])) for k in ceiling[0]}
    gap = ranks["step"] - ceiling["step"]
    return dict(ranks=ranks, ceiling=ceiling, efficiency=ceiling["step"] / ranks["step"],
                lost={k: ranks[k] - ceiling[k] for k in PARTS}, gap=gap,
                sum_of_parts=sum(ranks[k] for k in PARTS))
