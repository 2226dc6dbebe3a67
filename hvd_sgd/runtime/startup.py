"""Before and during hvd.init: version checks, process tuning, pinning.

Some of this must happen before Horovod or TensorFlow start (environment variables, thread
counts), so it reads the launcher's variables rather than asking Horovod.
"""
import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import time

import tensorflow as tf

from hvd_sgd import JobError
from hvd_sgd.runtime import announced, cpu_slice, mpirun

try:
    import horovod.tensorflow as hvd
except (ImportError, tf.errors.NotFoundError) as e:  # reported by start(), after the clearer checks
    hvd, _HOROVOD_IMPORT_ERROR = None, e

def check_versions():
    """Stop early when Horovod was not built against this TensorFlow (its extension would not
    load, or misbehave). Keras 3 is fine: hvd_sgd.training.distributed averages the gradients there."""
    spec = importlib.util.find_spec("horovod")
    if spec is None:
        raise JobError("Horovod is not installed: run run/setup")
    with open(os.path.join(spec.submodule_search_locations[0], "metadata.json")) as f:
        built_against = json.load(f).get("tensorflow")
    if built_against != tf.__version__:
        raise JobError(f"Horovod was built against TensorFlow {built_against} but TensorFlow {tf.__version__} "
                       f"is installed: rebuild Horovod (run/setup) or reinstall TensorFlow {built_against}")


def check_mpi():
    """Stop, in one line, a rank that another MPI's launcher started than the MPI Horovod was built
    with: MPI_Init would abort every rank, each with its own error (a `module swap` after run/setup,
    or another mpirun on the PATH)."""
    built, launcher = mpirun.recorded(), mpirun.launched_by()
    if mpirun.mismatch(built.get("mpi"), launcher):
        raise JobError(f"Horovod is built with {built['mpi']} ({built['prefix']}) but {launcher}'s launcher started "
                       f"this rank: start it with the installation's mpirun, or load {built['mpi']}; "
                       f"run/setup builds for the MPI on the PATH")


def start(threads_per_rank=0, stall_timeout=60.0, bind_cpus=True, timeline=False):
    """hvd.init, then pin this rank to one GPU (by local rank) and to its share of the CPU cores.

    Horovod's stall check is set to shut the job down, not only warn, after ``stall_timeout``
    seconds in which the ranks submitted different collectives. ``stall_timeout`` None: the
    caller's watchdog watches for stalls, and Horovod's check is off, since it would also end a
    job whose rank 0 writes a checkpoint alone for that long, or that was suspended. The user's
    HOROVOD_STALL_* settings win either way. ``timeline``: Horovod's timeline can be started and
    stopped while the job runs (hvd.start_timeline), which every rank must allow before hvd.init.
    """
    imported = time.time()  # Python, TensorFlow, Horovod and the arguments: before this
    check_versions()
    check_mpi()
    if not any(name.startswith("HOROVOD_STALL_") for name in os.environ):
        os.environ.update({"HOROVOD_STALL_CHECK_DISABLE": "1"} if stall_timeout is None else {
            "HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, int(stall_timeout) // 2)),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(max(1, int(stall_timeout)))})
    if timeline:
        if os.environ.get("HOROVOD_TIMELINE", "DYNAMIC") != "DYNAMIC":
            raise JobError(f"--timeline: HOROVOD_TIMELINE={os.environ['HOROVOD_TIMELINE']} is set too, which records "
                           f"the whole run: unset it")
        os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
    yield_when_idle()
    os.environ.setdefault("HOROVOD_CYCLE_TIME", _cycle_time_ms())
    # Read when TensorFlow creates its CPU device, after this. Its default CPU allocator hands large
    # tensors (an all-reduce's output) back to the OS and faults fresh pages in for the next one;
    # BFC keeps them (docs/design.md, "TensorFlow's CPU allocator"). With oneDNN on
    # (hvd_sgd's default) TensorFlow pools through oneDNN's allocator instead; this is for oneDNN off.
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    if hvd is None:
        built = mpirun.recorded()
        raise JobError(f"Horovod's TensorFlow extension does not load ({_HOROVOD_IMPORT_ERROR}): " + (
            f"it is built with {built['mpi']} ({built['prefix']}): load that MPI, or run run/setup with the "
            f"one you load" if built.get("mpi") and "libmpi" in str(_HOROVOD_IMPORT_ERROR) else "rebuild it with run/setup --force"))
    trace_horovod_without_autograph()
    if announced.by_mpi():
        abi = mpirun.mpi4py_abi()
        if abi:
            os.environ.setdefault("MPI4PY_MPIABI", abi)
        from mpi4py import MPI
        hvd.init(comm=MPI.COMM_WORLD)
    else:
        hvd.init()

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # the GPU path is not covered by the tests (docs/design.md, "GPUs")
        gpu = gpus[hvd.local_rank() % len(gpus)]
        tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(gpu, "GPU")
        device = f"GPU {gpu.name}"
    else:
        device = "CPU"
    cpu_share = _bind_to_cpu_share(bind_cpus)  # binds, whatever --threads-per-rank says
    threads = _use_threads(threads_per_rank or cpu_share)
    from hvd_sgd.runtime.world import World  # imports Horovod's extension: only once it is known to load
    return World(device, threads, dict(imports=imported, horovod=time.time()))


def trace_horovod_without_autograph():
    """Horovod 0.28.1 makes its gradient all-reduce and its variables' broadcast tf.functions with
    autograph on, so each rank's first step converts Horovod's own Python source: seconds of CPU a
    rank (docs/design.md, "Start-up"). That code branches only on Python values (its branches
    on tensors are explicit tf.cond), so it traces as written."""
    import horovod.tensorflow.functions
    for module in (hvd, horovod.tensorflow.functions):
        module._make_subgraph = functools.partial(tf.function, autograph=False)


def yield_when_idle():
    """Before MPI starts: Open MPI busy-polls inside MPI calls, and Horovod's background thread
    negotiates through MPI every cycle, so a rank waiting for a slower one would spin on the cores
    its TensorFlow threads need; across hosts, spinning ranks also hold off the kernel's network
    work on those cores (docs/design.md, "Open MPI yields when idle")."""
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


def _cycle_time_ms():
    """Horovod's background thread sleeps for a cycle (1 ms by default) between negotiations, and
    an all-reduce waits for the next one. While every rank has a core of its own, not sleeping at
    all is fastest; where ranks outnumber the cores, those threads would spin on the cores
    training needs: 0.1 ms there (docs/design.md, "Horovod's cycle, and its patched thread"). One rank negotiates nothing."""
    if announced.size() == 1:
        return "1"  # Horovod's default
    ranks_here = announced.local_size()
    return "0" if ranks_here <= (os.cpu_count() or 1) else "0.1"


def _bind_to_cpu_share(bind):
    """Bind this rank to its share of the CPUs unless its launcher did; how many CPUs it may use.

    mpirun binds each rank to its own core by default (up to 2 ranks), srun --cpu-bind too: such
    a mask, smaller than the machine, is kept. horovodrun passes ``-bind-to none``: local rank r
    is then bound to the r-th equal slice of the CPUs, all its threads included (Horovod's
    background thread is already running). Left unbound, the OS at times puts two ranks' busy
    threads on one core (docs/design.md, "One rank per core, bound to it"). A container limited to fewer CPUs
    than the host looks bound too: its ranks are not rebound. (Comparing the ranks' masks would
    tell, but no collective can run here: TensorFlow's thread counts must be set before its first op.)
    Under Gloo (horovodrun --gloo, elastic runs) a rank stays unbound: every all-reduce passes
    through Gloo's TCP thread, which on the rank's one core waits behind the compute
    (same note).
    """
    cpus = os.sched_getaffinity(0)
    if len(cpus) < (os.cpu_count() or len(cpus)):
        return len(cpus)  # bound by the launcher
    own = cpu_slice(hvd.local_rank(), hvd.local_size())
    if bind and hvd.local_size() > 1 and own and not hvd.gloo_enabled():
        for thread in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
                os.sched_setaffinity(int(thread), own)
    return max(1, len(own))


def _use_threads(threads):
    """TensorFlow's thread pools of ``threads``; the number it has. Its pools are fixed once its runtime
    has started in this process (hvd_sgd.fit called in a notebook, or a second time): then it keeps them."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
        return threads
    except RuntimeError:
        return tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
