"""A program's process: its exit statuses, and a JobError as one line from one rank.

    EXIT_OK 0, EXIT_FAILED 1 (a JobError: bad input, divergence, a lost rank), EXIT_STOPPED 75
    (stopped on a signal after a checkpoint: the same command with --resume continues).
"""
import sys
import time

from hvd_sgd import JobError, first_line
from hvd_sgd.runtime import announced

EXIT_FAILED = 1
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, to be continued; not a failure
# How long another rank waits before it exits on an error that the first rank reports: mpirun
# ends the job when any rank fails, and the first rank may still be starting up.
ERROR_GRACE_SECONDS = 5


class Stopped(JobError):
    """The run stopped on a signal, after a checkpoint of its last step if it has a directory."""


class RankError(JobError):
    """What only this rank knows, found while the others wait for it in a collective (a training
    image that does not decode): this rank says it, in the one line of the job."""


def run(main, prog):
    """Run ``main``; a JobError becomes one line on stderr from the first rank and EXIT_FAILED on all.

    So does a collective that failed because another rank did (Horovod's shutdown, or Gloo's timeout
    on a rank that vanished): the launcher or rank 0's watchdog names that rank, and the survivors
    need not add a traceback each. A stop on a signal is one line too, and EXIT_STOPPED.
    """
    try:
        main()
    except Exception as e:
        if not isinstance(e, JobError) and not _collective_failed(e):
            raise
        stopped, rank = isinstance(e, Stopped), announced.rank()
        if announced.is_chief() or isinstance(e, RankError):
            where = f"rank {rank}: " if isinstance(e, RankError) and rank else ""
            print(f"{prog}: {'' if stopped else 'error: '}{where}{first_line(e, limit=None)}", file=sys.stderr,
                  flush=True)
        elif not stopped:
            # The first rank's exit ends the job at once; an error only this rank saw costs the wait.
            time.sleep(ERROR_GRACE_SECONDS)
        sys.exit(EXIT_STOPPED if stopped else EXIT_FAILED)


# What Gloo's transport says in a Horovod op whose peer is gone. Any other error of a Horovod op (out
# of memory, say) is this rank's own: it keeps its traceback.
PEER_GONE = ("Timed out waiting", "pair closure", "Connection closed by peer")


def _collective_failed(error):
    """Horovod's shutdown, or a Horovod op's error (its node's name) that its peer is gone."""
    text = str(error)
    return "Horovod has been shut down" in text or (type(error).__module__.startswith("tensorflow")
                                                    and "Horovod" in text and any(s in text for s in PEER_GONE))
