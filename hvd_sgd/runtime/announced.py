"""What the launcher announced to this process, in its environment: its rank and the job's size,
whether it is the chief, which kind of launcher started it, a Slurm requeue. Usable before Horovod
starts and after it has shut down; importing it imports neither TensorFlow nor Horovod."""
import contextlib
import os
import sys

# Set by the launchers before our process starts: Horovod's Gloo launcher, Open MPI, PMIx (srun --mpi=pmix), PMI.
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")
LOCAL_SIZE_VARIABLES = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")  # else: all ranks on this node


def rank():
    """This process's rank as the launcher announced it (0 when started without one)."""
    return _first(RANK_VARIABLES, 0)


def size():
    """The number of ranks as the launcher announced it (1 when started without one)."""
    return _first(SIZE_VARIABLES, 1)


def local_size():
    """The number of ranks on this node (all of them, when the launcher does not say)."""
    return _first(LOCAL_SIZE_VARIABLES, size())


def is_chief():
    """Whether this process is rank 0, the one that speaks and writes: Horovod's rank once Horovod has
    started (an elastic job renumbers its ranks), the launcher's before and after it has shut down.
    ``World.is_chief`` asks this."""
    hvd = sys.modules.get("horovod.tensorflow")  # Horovod has not started unless it was imported
    if hvd is not None and hvd.is_initialized():
        with contextlib.suppress(ValueError):  # shut down since: it has no rank any more
            return hvd.rank() == 0
    return rank() == 0


def by_mpi():
    """Whether an MPI launcher (mpirun, srun with PMIx or PMI) started this process, not Horovod's Gloo."""
    return "HOROVOD_RANK" not in os.environ and any(v in os.environ for v in MPI_VARIABLES)


def elastic():
    """Whether horovodrun started this rank in elastic mode (--min-np, --max-np, --host-discovery-script)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def slurm_requeued():
    """"job ID (restart N)" when Slurm requeued this job (after a stop, a node failure, preemption); "" if not."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    return f"job {os.environ.get('SLURM_JOB_ID')} (restart {restarts})" if restarts > 0 else ""


def _first(variables, default):
    return next((int(os.environ[v]) for v in variables if v in os.environ), default)
