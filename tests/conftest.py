"""Helpers that the test files share: launching hvd_sgd the way users do (hvd_sgd.bench.launchers), small
IDX datasets, and long runs in the background with the faults done to them."""
import gzip
import importlib.util
import json
import os
import platform
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from hvd_sgd.bench import launchers
from hvd_sgd.data import datasets
from hvd_sgd.training import distributed

ROOT = Path(__file__).resolve().parents[1]
collect_ignore = ["horovod"]  # Horovod's own tests, which test_horovod_suite runs under mpirun
PYTHON = sys.executable
STACK = "current" if distributed.KERAS_3 else "keras2"  # the stack of this Python (run/lib.sh)
# Tagged output of the launchers: "[1,0]<stdout>:" (mpirun --tag-output), "[0]<stdout>:" (Gloo),
# "[0] " (horovodrun over MPICH: -prepend-rank); Open MPI 5 puts a space after the tag. Open MPI
# tags every chunk it reads, so an unbuffered print(a, b) can carry tags inside its line too.
_TAG = re.compile(r"\[[\d,]+\]<std(?:out|err)>: ?|^\[\d+\] ")


@pytest.fixture(autouse=True)
def processes_only_when_slow(request, monkeypatch):
    """The quick tier (-m "not slow") starts no process: a test that does must be marked slow. A
    test that forgets is failed here, so the marks cannot drift from what the tests do."""
    if request.node.get_closest_marker("slow"):
        return
    platform.processor()  # Python asks `uname -p` once, and keeps the answer: asked here, before the guard

    def refused(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts a process: mark it slow", pytrace=False)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refused)
    monkeypatch.setattr(os, "fork", refused)


@pytest.fixture(autouse=True)
def environment_restored():
    """A run in the test's own process (the quick tier's) sets Horovod's and TensorFlow's variables in
    os.environ (HOROVOD_CYCLE_TIME for one rank, say): the processes later tests start must not
    inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def launch(launcher, np_, *args, module="hvd_sgd.train", timeout=240, env=None, exits_dir=None, wrapper=()):
    """Run hvd_sgd under a real launcher; returns the CompletedProcess (text output).

    ``exits_dir``: mpirun only; every rank runs to its own end (mpirun does not kill the others
    when one fails) and writes its exit status to ``exits_dir/rank-N``.
    ``wrapper``: mpirun only; a command that each rank runs the program through
    (``sh -c '…; exec "$@"' sh``).
    """
    before = tuple(wrapper)
    if exits_dir is not None:
        assert launcher == "mpirun" and not wrapper
        before = ("--mca", "orte_abort_on_non_zero_status", "0", "sh", "-c",
                   f'"$@"; status=$?; echo $status > {exits_dir}/rank-$OMPI_COMM_WORLD_RANK; exit $status', "sh")
    command = launchers.command(launcher, np_, module, args, before_program=before)
    return subprocess.run(command, cwd=ROOT, env=launchers.environment(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)


class Cgroup:
    """A cgroup of a test's own with one controller ("memory" or "io"), on cgroup v1 (a hierarchy per
    controller, as on this machine) or v2 (one hierarchy: Debian 12 and most clusters). Where it
    cannot be made (no root, no such controller), the test is skipped, saying why."""
    V2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    V1_NAMES = {"memory": "memory", "io": "blkio"}

    def __init__(self, controller):
        self.require(controller)
        root = "/sys/fs/cgroup" if self.V2 else f"/sys/fs/cgroup/{self.V1_NAMES[controller]}"
        self.path = f"{root}/hvd_sgd-test-{os.getpid()}-{controller}"
        os.makedirs(self.path, exist_ok=True)

    @classmethod
    def unusable(cls, controller):
        """Why this process cannot have a cgroup with ``controller``; None when it can."""
        if os.geteuid() != 0:
            return f"a {controller} cgroup of its own needs root (cgroup {'v2' if cls.V2 else 'v1'})"
        if not cls.V2:
            exists = os.path.isdir(f"/sys/fs/cgroup/{cls.V1_NAMES[controller]}")
            return None if exists else f"cgroup v1 without the {cls.V1_NAMES[controller]} hierarchy"
        if controller not in open("/sys/fs/cgroup/cgroup.controllers").read().split():
            return f"cgroup v2 without the {controller} controller"
        try:  # the children of the root may use it
            with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
                f.write(f"+{controller}")
        except OSError as e:
            return f"cgroup v2: the {controller} controller cannot be given to a child ({e.strerror})"
        return None

    @classmethod
    def require(cls, controller):
        """Skip the test now, before its set-up, if it cannot have a cgroup with ``controller``."""
        unusable = cls.unusable(controller)
        if unusable:
            pytest.skip(unusable)

    def _write(self, name, value):
        with open(f"{self.path}/{name}", "w") as f:
            f.write(value)

    def limit_memory(self, nbytes):
        self._write("memory.max" if self.V2 else "memory.limit_in_bytes", str(nbytes))

    def peak_memory(self):
        """The peak of its members' memory, in bytes (v2: memory.peak, Linux 5.19 and later)."""
        return int(open(f"{self.path}/{'memory.peak' if self.V2 else 'memory.max_usage_in_bytes'}").read())

    def throttle(self, device, read=0, write=0):
        """Bytes a second that its members read from and write to ``device`` (0: no limit)."""
        major_minor = f"{os.major(os.stat(device).st_rdev)}:{os.minor(os.stat(device).st_rdev)}"
        if self.V2:
            self._write("io.max", f"{major_minor} rbps={read or 'max'} wbps={write or 'max'}")
        else:
            for direction, rate in (("read", read), ("write", write)):
                self._write(f"blkio.throttle.{direction}_bps_device", f"{major_minor} {rate}")

    def command(self, command):
        """``command`` run in this cgroup (its children too)."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *map(str, command)]

    def remove(self):
        """Kill what is still in it (a failed test's run), then remove it."""
        with open(f"{self.path}/cgroup.procs") as f:
            left = [psutil.Process(int(pid)) for pid in f.read().split()]
        for process in left:
            process.kill()
        psutil.wait_procs(left, timeout=30)
        os.rmdir(self.path)


def rank_exits(exits_dir):
    return sorted(int(p.read_text()) for p in Path(exits_dir).iterdir())


def output_lines(text):
    return [_TAG.sub("", line) for line in text.splitlines() if _TAG.sub("", line).strip()]


def error_lines(result, prog="hvd_sgd.train"):
    return [line for line in output_lines(result.stderr) if f"{prog}: error:" in line]


def succeeded(result):
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    return result


def reported_accuracy(result):
    """The last line rank 0 printed must be 'Test accuracy: 0.XXXX'."""
    last = output_lines(result.stdout)[-1]
    match = re.fullmatch(r"Test accuracy: (\d\.\d{4})", last)
    assert match, f"last line is {last!r}"
    return float(match.group(1))


def read_json(path):
    with open(path) as f:
        return json.load(f)


def saved_weights(path):
    """Weights of a saved .keras model, read by plain TensorFlow."""
    import tensorflow as tf
    return [np.asarray(w) for w in tf.keras.models.load_model(path).get_weights()]


def train_and_save(tmp_path, name, launcher, np_, *args):
    """Train, save the model as ``tmp_path/name.keras``, return its weights."""
    path = tmp_path / f"{name}.keras"
    succeeded(launch(launcher, np_, *args, "--save-model", path))
    return saved_weights(path)


def assert_same_weights(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def max_difference(a, b):
    return max(np.abs(x - y).max() for x, y in zip(a, b, strict=True))


@pytest.fixture
def tiny_run():
    """Flags for a short run on a small MNIST subset."""
    return ["--train-examples", 2048, "--test-examples", 1000, "--log-every-steps", 10]


# --- small datasets in standard IDX files --------------------------------------------------------

def write_idx(path, array, magic=None, dims=None, cut=0, extra=b""):
    array = np.asarray(array, np.uint8)
    dims = array.shape if dims is None else dims
    raw = (magic or bytes([0, 0, 8, len(dims)])) + struct.pack(f">{len(dims)}I", *dims) + array.tobytes() + extra
    raw = raw[:len(raw) - cut]
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(raw)


def random_arrays(n_train=12, n_test=5, shape=(4, 4), seed=0):
    rng = np.random.default_rng(seed)
    return dict(x_train=rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
                y_train=rng.integers(0, 10, n_train, dtype=np.uint8),
                x_test=rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
                y_test=rng.integers(0, 10, n_test, dtype=np.uint8))


def write_dataset(directory, n_train=12, n_test=5, gz=True, **overrides):
    arrays = random_arrays(n_train, n_test)
    arrays.update(overrides)
    for key, (name, _) in datasets.IDX_FILES.items():
        write_idx(directory / (name + (".gz" if gz else "")), arrays[key])
    return arrays


# --- long runs in the background, and what happens to them --------------------------------------

def rank_process(launcher, rank):
    """The training process of one rank among the launcher's descendants."""
    for child in launcher.children(recursive=True):
        try:
            env = child.environ()
            if child.cmdline()[:1] == [PYTHON] and rank == int(env.get("HOROVOD_RANK", env.get("OMPI_COMM_WORLD_RANK", -1))):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def start_and_wait(command, ready, timeout, env=None):
    process = subprocess.Popen(list(map(str, command)), cwd=ROOT, env=env or launchers.environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, ("the run ended before it got ready", process.communicate())
        assert time.monotonic() < deadline, "the run never got ready"
        time.sleep(0.2)
    return process


def latest_checkpoint_step(directory):
    """The step of the checkpoint that ``directory``'s index names last."""
    import tensorflow as tf
    return int(tf.train.latest_checkpoint(str(directory)).rsplit("-", 1)[1])


def ended_within(process, seconds):
    try:
        stdout, stderr = process.communicate(timeout=seconds)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {seconds} s")


LONG_STEPS = 2000  # 32 steps an epoch, ~2 ms a step: seconds of run left after the first checkpoints
LONG_RUN = ["--model", "mlp", "--train-examples", 16384, "--test-examples", 500, "--batch-size", 256,
            "--epochs", 100, "--max-steps", LONG_STEPS, "--log-every-steps", 10, "--checkpoint-every-steps", 50]


def frozen(process):
    """SIGSTOP ``process`` and wait until it has stopped: the signal is delivered asynchronously, and
    on a fast machine the run can still write a file after send_signal returns."""
    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.01)
    return process


def checkpoint_from_step(directory, step):
    """Whether a checkpoint of ``step`` or later is recorded (older ones are rotated away, so wait for
    any). Recorded: named in the directory's state file, which TensorFlow replaces after the
    checkpoint's files are written and which --resume reads; a run killed between the two resumes
    from the checkpoint before (CI once killed one there)."""
    def recorded():
        state = directory / "checkpoint"
        return state.exists() and any(int(n) >= step for n in re.findall(r'ckpt-(\d+)"', state.read_text()))
    return recorded


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("uninterrupted") / "model.keras"
    succeeded(launch("mpirun", 2, *LONG_RUN, "--save-model", path))
    return saved_weights(path)


# --- Slurm jobs (run/slurm/local-cluster, run/cluster --slurm) ----------------------------------

def run_job(env, *sbatch_args, timeout=240):
    """Submit a batch job and wait for it to end; its final state."""
    return wait_for_job(env, submit_job(env, *sbatch_args), timeout)


def submit_job(env, *sbatch_args):
    job = subprocess.run(["sbatch", "--parsable", *map(str, sbatch_args)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    job_id = job.stdout.strip().split(";")[0]
    assert job_id.isdigit(), job.stderr
    return job_id


def job_state(env, job_id, patience=30):
    """(state, restarts) of the job. A busy slurmctld can time out a query (CI saw one while a job
    was requeued): ask again for up to ``patience`` seconds before failing with its message."""
    deadline = time.monotonic() + patience
    while True:
        info = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True)
        state, restarts = re.search(r"JobState=(\w+)", info.stdout), re.search(r"Restarts=(\d+)", info.stdout)
        if state and restarts:
            return state.group(1), int(restarts.group(1))
        assert time.monotonic() < deadline, f"scontrol show job {job_id}: {info.stderr or info.stdout}"
        time.sleep(1)


def wait_for_job(env, job_id, timeout=240, hurry_requeued=False, until=None):
    """Poll every half second (sbatch --wait polls every 10 s or so) until the job ends, or until
    ``until(state, restarts)``; its state then. ``hurry_requeued``: start a requeued job after 10 s
    pending, not the 2 minutes Slurm holds it (at once, its new step can collide with the old
    one's teardown: "aborted before step completely launched")."""
    deadline, pending_since = time.monotonic() + timeout, None
    while True:
        state, restarts = job_state(env, job_id)
        # SIGNALING and STAGE_OUT pass as the job is signalled or ends (CI saw SIGNALING at the warning).
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "SIGNALING", "COMPLETING", "STAGE_OUT", "REQUEUED") or (
                until and until(state, restarts)):
            return state
        if hurry_requeued and state == "PENDING" and restarts:
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since > 10:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env,
                               capture_output=True)
        else:
            pending_since = None
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s"
        time.sleep(0.5)


# --- memory --------------------------------------------------------------------------------------

# Each rank runs its program under this, which prints the program's peak resident memory.
PEAK_MEMORY = ("import resource, subprocess, sys; status = subprocess.call(sys.argv[1:]); "
               "print('peak KiB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(status)")


def peak_memory(data, *args, limit=None, job=True):
    """Two ranks training softmax on ``data`` (3 steps, unless ``args`` say otherwise): the larger
    rank's peak resident memory and, ``job``, the job's peak in a memory cgroup of its own (else
    None), in bytes. ``limit``: the cgroup's limit in bytes (a job that needs more is reclaimed
    from, then killed)."""
    softmax = ["--model", "softmax", "--data-dir", data, *(args or ("--max-steps", 3))]
    command = launchers.command("mpirun", 2, "hvd_sgd.train", softmax, before_program=(PYTHON, "-c", PEAK_MEMORY))
    cgroup = Cgroup("memory") if job else None
    try:
        if limit:
            cgroup.limit_memory(limit)
        result = succeeded(subprocess.run(cgroup.command(command) if cgroup else command, cwd=ROOT,
                                          env=launchers.environment(), capture_output=True, text=True, timeout=240))
        peak = cgroup.peak_memory() if cgroup else None
    finally:
        if cgroup:
            cgroup.remove()
    rank = max(int(line.split()[-1]) for line in output_lines(result.stdout) if line.startswith("peak KiB"))
    return rank * 1024, peak


# --- image sets on files, whose images carry their ids --------------------------------------------

RECORDER = textwrap.dedent('''
    """A model that records the id of every training example it sees (pixels (0, 0) and (0, 1))."""
    import os
    import time

    import tensorflow as tf

    @tf.keras.utils.register_keras_serializable("tests")
    class Record(tf.keras.layers.Layer):
        def call(self, images, training=None):
            if training:
                tf.py_function(self.write, [images[:, 0, 0, 0], images[:, 0, 1, 0]], [])
            return images

        def write(self, high, low):
            time.sleep(float(os.environ.get("RECORD_SECONDS", 0)))  # a step as long as this, at least
            ids = tf.cast(tf.round(high * 255) * 256 + tf.round(low * 255), tf.int64).numpy()
            rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0"))
            with open(os.path.join(os.environ["IDS_DIR"], f"rank-{rank}"), "a") as f:
                f.write(" ".join(map(str, ids)) + "\\n")

    def model(input_shape, num_classes):
        return tf.keras.Sequential([tf.keras.Input(input_shape), Record(), tf.keras.layers.Flatten(),
                                    tf.keras.layers.Dense(num_classes, name="logits")])
''')


def id_images(n_train, n_test, shape=(8, 8), classes=10, seed=0):
    """Random images whose first two pixels hold their id (test ids from 50000), labels by id."""
    rng = np.random.default_rng(seed)

    def split(n, first):
        images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        ids = np.arange(first, first + n)
        channels = (1,) * (len(shape) - 2)  # every channel of a colour pixel
        images[:, 0, 0], images[:, 0, 1] = (ids // 256).reshape(n, *channels), (ids % 256).reshape(n, *channels)
        return images, (ids % classes).astype(np.uint8)
    (x_train, y_train), (x_test, y_test) = split(n_train, 0), split(n_test, 50000)
    return datasets.Splits("ids", x_train, y_train, x_test, y_test)


def exported(path, layout, splits, **options):
    """``splits`` written by hvd_sgd's converter as ``layout`` (PNG unless ``image_format`` says)."""
    from hvd_sgd.data import convert  # TensorFlow: only in the tests that make image sets
    convert.export(splits, str(path), layout, image_format=options.pop("image_format", "png"), **options)
    return path


def ids_by_rank(directory, ranks):
    """Each rank's recorded ids, a row a step."""
    return [np.array([line.split() for line in (directory / f"rank-{r}").read_text().splitlines()], np.int64)
            for r in range(ranks)]


def recorder(directory):
    """The recording model's module, written into ``directory`` and imported here too (a saved model
    of it needs its layer's class to load)."""
    (directory / "recorder.py").write_text(RECORDER)
    spec = importlib.util.spec_from_file_location("recorder", directory / "recorder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_recorded(tmp_path, name, data, np_, batch, *args, launcher="mpirun"):
    """Train the recording model on ``data``; (ids by rank, the saved model's weights, metrics)."""
    ids = tmp_path / f"ids-{name}"
    ids.mkdir()
    recorder(tmp_path)
    model, metrics = tmp_path / f"{name}.keras", tmp_path / f"{name}.json"
    succeeded(launch(launcher, np_, "--model", "recorder:model", "--data-dir", data, "--batch-size", batch,
                     "--lr", 0.05, "--no-lr-scaling", "--save-model", model, "--metrics-file", metrics, *args,
                     env={"PYTHONPATH": str(tmp_path), "IDS_DIR": str(ids)}))
    return ids_by_rank(ids, np_), saved_weights(model), read_json(metrics)
