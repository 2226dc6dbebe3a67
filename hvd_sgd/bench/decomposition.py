"""Where a step's time goes: the parts of a 2-rank step, against the ceiling's, in one job.

workers.decompose runs three steps in alternating blocks on the same ranks: the ceiling (no
all-reduce, each rank on its own), the same step with the gradients averaged ("together"), both
with timestamps of each step's parts, and hvd_sgd's own ``fit``. From the timestamps: the batch
gathered and the forward and backward passes (compute), the all-reduce cut into the wait for the
slowest rank (how much later than this rank the last one arrived) and the rest of it (Horovod's
queue and cycle, the transfer), the update, and the rest (Python between steps). The parts add up
to the step, step by step. hvd_sgd's own step adds what its loop and optimizer wrapper do beyond
the bare step (part "hvd_sgd"). Blocks side by side in one job: this machine's speed drifts by
more from one minute to the next than 2 ranks lose.
"""
import numpy as np

PARTS = ("compute", "wait", "allreduce", "update", "rest")


def _block_parts(blocks, one_host):
    """Each part's mean over the steps and ranks of one block, in ms, and the block's step (one
    step's start to the next's); ``blocks``: each rank's timestamps [steps, 4] of the same block."""
    start, computed, reduced, end = np.stack(blocks).transpose(2, 0, 1)  # each [ranks, steps]
    # One host: one clock, so the last rank's arrival at the all-reduce is known; across hosts the
    # spread of the ranks' compute times stands for it.
    arrival = computed if one_host else computed - start
    wait = np.minimum(arrival.max(axis=0) - arrival, reduced - computed)
    measured = dict(compute=computed - start, wait=wait, allreduce=reduced - computed - wait, update=end - reduced,
                    rest=np.concatenate([start[:, 1:] - end[:, :-1], np.zeros((len(start), 1))], axis=1))
    result = {k: float(v[:, :-1].mean()) * 1e3 for k, v in measured.items()}
    result["step"] = float(np.diff(start, axis=1).mean()) * 1e3
    # One rank slower than the other through the whole block (a core shared with another
    # machine's work): the wait it alone explains, the rest of the wait being step-to-step noise.
    mean_compute = (computed - start).mean(axis=1)
    result["slower_rank"] = float(mean_compute.max() - mean_compute.mean()) * 1e3
    return result


def _by_block(report, kind, one_host):
    return [_block_parts([r[kind][b] for r in report["ranks"]], one_host) for b in range(len(report["ranks"][0][kind]))]


def _mean(blocks):
    return {k: float(np.mean([b[k] for b in blocks])) for k in blocks[0]}


def row(report):
    """One job's report (workers.decompose): the parts of the step together and of the ceiling (ms,
    means over blocks), hvd_sgd's own step, efficiency (the ceiling's step over hvd_sgd's, the
    median of the blocks' ratios, each from steps seconds apart; ``bare``: over the step together),
    what 2 ranks lose in each part, and the sum of the parts."""
    one_host = len({r["host"] for r in report["ranks"]}) == 1
    together, ceiling = _by_block(report, "together", one_host), _by_block(report, "ceiling", one_host)
    own = [report["global_batch"] / rate * 1e3 for rate in report["hvd_sgd"]]  # ms a step, its own clock
    own_step = float(np.mean(own))
    ranks, alone = _mean(together), _mean(ceiling)
    ranks["hvd_sgd"], alone["hvd_sgd"] = own_step - ranks["step"], 0.0
    lost = {k: ranks[k] - alone[k] for k in (*PARTS, "hvd_sgd")}
    return dict(ranks=ranks, ceiling=alone, hvd_sgd_step=own_step,
                efficiency=float(np.median([c["step"] / o for c, o in zip(ceiling, own)])),
                efficiency_bare=float(np.median([c["step"] / t["step"] for c, t in zip(ceiling, together)])),
                lost=lost, gap=own_step - alone["step"],
                sum_of_parts=sum(ranks[k] for k in PARTS), blocks=len(own))
