"""The job's runtime around the ranks: what the launcher announced (announced), how a rank starts
(versions, Horovod, pinning: startup), who it is among the others (world), what stops or ends the
job (preemption, watchdog), and how a program ends (cli). The only room that reads the launcher's
environment. Importing it imports neither TensorFlow nor Horovod: the installation's mpirun runs
from here, and the bench's driver places processes with cpu_slice."""
import os

# One stop request often arrives twice: Ctrl-C reaches the launcher and the ranks, and mpirun forwards
# SIGUSR1 to ranks that got it from the batch system too. Within this window it is the same request
# (preemption in the ranks, mpirun in the launcher).
SAME_REQUEST_SECONDS = 1.0


def cpu_slice(index, count):
    """The ``index``-th of ``count`` equal slices of the CPUs this process may use (empty when there
    are more slices than CPUs): where hvd_sgd binds local rank ``index`` of ``count`` when its
    launcher did not, and where the benchmark's ceiling places its processes to match."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // count
    return cpus[index * share:(index + 1) * share]
