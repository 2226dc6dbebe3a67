"""The installation's ``mpirun`` (and ``mpiexec``): the MPI's own, with what a cluster's faults need.

run/setup puts ``mpirun`` and ``mpiexec`` scripts beside the installation's Python that run this
module, so that ``mpirun`` from the activated environment, ``horovodrun`` (patched to prefer
them), ``run/train`` and the job script all start jobs the same way:

- Open MPI's daemons probe an idle connection only after 300 s, then 9 probes 20 s apart: a node
  cut off from the network held a job for 8 minutes. Here a silent daemon is probed after 10 s,
  3 times 5 s apart, so the job ends in about 25 s, naming the node (docs/design.md, "Launchers").
- SIGTERM, SIGINT or SIGUSR1 to this process reaches mpirun as SIGUSR1, which mpirun passes to
  every rank: hvd_sgd stops them all after the same step, with its checkpoint (status 75). On its
  own SIGTERM mpirun would kill the ranks a second later. A second signal is mpirun's SIGTERM.
- Under Open MPI 5, the long options older launchers spell with one dash (horovodrun's
  ``-bind-to none -map-by slot``) are given two.
- A lost node is one line (LostNodeReport): the launcher's stderr passes through this process,
  and once a node is known lost, Open MPI's further banners (a daemon "unable to start", a peer
  "hung up") go to a file that the line names.

The user's own ``OMPI_MCA_*`` settings win. ``<venv>/share/hvd_sgd/mpi.json`` names the MPI's
launcher that Horovod was built with; without it, the first other ``mpirun`` on the PATH.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from hvd_sgd.runtime import SAME_REQUEST_SECONDS

OPEN_MPI_DEFAULTS = {
    "OMPI_MCA_oob_tcp_keepalive_time": "10",
    "OMPI_MCA_oob_tcp_keepalive_intvl": "5",
    "OMPI_MCA_oob_tcp_keepalive_probes": "3",
}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
# Open MPI 5's launcher (prterun) takes these long options with two dashes only, and reads "-map-by"
# as the program's name; Open MPI 4, MPICH and horovodrun's command line (Horovod 0.28.1) use one.
SINGLE_DASH_OPTIONS = {"-bind-to": "--bind-to", "-map-by": "--map-by", "-rank-by": "--rank-by"}


# What says a node is lost: ssh's end of the connection to a daemon's node (Open MPI's rsh launcher),
# or Open MPI's banner for a daemon that went silent ("ORTE"/"PRTE has lost communication ...").
LOST_NODE = (re.compile(rb"^Connection to (\S+) closed by remote host\."),
             re.compile(rb"^\s*Remote daemon\s*: .* on node (\S+)"))
BANNER_RULE = re.compile(rb"^-{20,}\s*$")  # the line above and below each Open MPI banner
BANNER_LINES = 60  # held at most: a rule that opens no banner (a rank's own) holds nothing for long
LAUNCHER_NOTE = re.compile(rb"^\[[^\]\s]+:\d+\] ")  # mpirun's own "[node1:10801] 1 more process has sent ..."
RANK_TAG = re.compile(rb"^\[\d+,\d+\]<std(?:out|err)>:")  # a rank's line under --tag-output (horovodrun's)
DRAIN_SECONDS = 2  # after mpirun ends, for what it wrote last (an ssh it left may hold the pipe open)


class LostNodeReport:
    """mpirun's stderr as the user sees it: a node's loss is one line, not three banners.

    When a node's processes are killed, Open MPI prints ssh's "Connection to node2 closed", a
    banner saying daemons could not be started, and each rank's "peer hung up" naming the node;
    when a node is cut off, a banner naming its daemon. Lines pass through as they come, but a
    banner is held until its closing rule. The first sign of a lost node prints hvd_sgd's line;
    after it, banners and mpirun's own notes go to a file (every consequence of the loss), kept."""

    def __init__(self, write):
        self.write, self.banner, self.lost, self.kept, self.closed = write, None, [], None, False

    def feed(self, line):
        if self.closed:
            return
        rule = BANNER_RULE.match(RANK_TAG.sub(b"", line))
        if self.banner is not None:
            self.banner.append(line)
            if rule or len(self.banner) >= BANNER_LINES:
                banner, self.banner = self.banner, None
                self._emit(banner)
        elif rule:
            self.banner = [line]
        else:
            self._emit([line])

    def close(self):
        if self.banner:
            self._emit(self.banner)
        if self.kept:
            self.kept.close()
        self.closed = True

    def _emit(self, lines):
        untagged = [RANK_TAG.sub(b"", line) for line in lines]
        nodes = [m.group(1) for line in untagged for m in (p.match(line) for p in LOST_NODE) if m]
        consequence = self.lost and (len(lines) > 1 or LAUNCHER_NOTE.match(lines[0]))
        for node in nodes:
            if node not in self.lost:
                self.lost.append(node)
                self.write(f"hvd_sgd: error: node {node.decode()} lost (its launcher daemon's connection ended: the node "
                           f"went down, was cut off, or its processes were killed); the job ends. Open MPI's "
                           f"messages after it: {self._kept_path()}\n".encode())
        if nodes or consequence:
            self.kept.writelines(lines)
            self.kept.flush()
        else:
            for line in lines:
                self.write(line)

    def _kept_path(self):
        if self.kept is None:
            self.kept = tempfile.NamedTemporaryFile("wb", prefix="hvd_sgd-mpirun-", suffix=".txt", delete=False)
        return self.kept.name


def relay(stream, report, lock):
    for line in iter(stream.readline, b""):
        with lock:
            report.feed(line)


def to_stderr(line):
    """Write a line of mpirun's; a closed stderr (the user's terminal gone) must not stop the relay,
    or mpirun would block on a full pipe."""
    try:
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
    except OSError:
        pass


def recorded():
    """What run/setup recorded of the MPI Horovod was built with ({} if nothing)."""
    try:
        with open(os.path.join(sys.prefix, "share", "hvd_sgd", "mpi.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def launched_by(environ=os.environ):
    """The MPI whose launcher started this process, from the variables only that launcher sets:
    "Open MPI 5.0.11" (PRRTE names its version), "Open MPI 4" (ORTE), "MPICH" (Hydra's PMI), or
    None (no launcher, Slurm's srun, horovodrun's Gloo, or one not known)."""
    if "HOROVOD_RANK" in environ or "SLURM_STEP_ID" in environ:
        return None
    if "OMPI_COMM_WORLD_SIZE" in environ:
        if "OMPI_VERSION" in environ:
            return f"Open MPI {environ['OMPI_VERSION']}"
        return "Open MPI 4" if "OMPI_MCA_orte_hnp_uri" in environ else "Open MPI"
    if "PMI_RANK" in environ and ("PMI_FD" in environ or "PMI_PORT" in environ):
        return "MPICH"
    return None


def mismatch(built, launcher):
    """Whether an MPI built as ``built`` ("Open MPI 4.1.4", "MPICH 5.0.2") cannot run under
    ``launcher`` (launched_by): another implementation, or Open MPI of another major version."""
    if not built or not launcher:
        return False
    if _family(built) != _family(launcher):
        return True
    majors = [name.removeprefix("Open MPI").strip().split(".")[0] for name in (built, launcher)]
    return _family(built) == "Open MPI" and all(majors) and majors[0] != majors[1]


def _family(mpi):
    return "Open MPI" if mpi.startswith("Open MPI") else "MPICH"  # Intel MPI and MVAPICH: MPICH's ABI


def mpi4py_abi():
    """Which of mpi4py's builds loads the MPI Horovod was built with (MPI4PY_MPIABI): its ABI, not
    whichever libmpi.so the library path finds first."""
    built = recorded().get("mpi", "")
    return "openmpi" if built.startswith("Open MPI") else "mpich" if built else None


def real_launcher(name):
    """The MPI's own ``name`` (mpirun or mpiexec): the recorded one, or the PATH's, this one's directory left out."""
    here = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv[0] else None
    launcher = recorded().get(name)
    if launcher and os.access(launcher, os.X_OK):
        return launcher
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and os.path.abspath(d) not in (here, os.path.join(sys.prefix, "bin")))
    return shutil.which(name, path=path)


def main(argv=None):
    name, *args = sys.argv[1:] if argv is None else argv
    launcher = real_launcher(name)
    if launcher is None:
        sys.exit(f"hvd_sgd: no {name} of an MPI on the PATH (run/setup records the one Horovod is built with)")
    env = {**OPEN_MPI_DEFAULTS, **os.environ}
    built = recorded().get("mpi", "")
    if built.startswith("Open MPI") and not built.startswith(("Open MPI 3", "Open MPI 4")):
        args = [SINGLE_DASH_OPTIONS.get(arg, arg) for arg in args]
    child = subprocess.Popen([launcher, *args], env=env, stderr=subprocess.PIPE)
    lock = threading.Lock()
    report = LostNodeReport(to_stderr)
    reader = threading.Thread(target=relay, args=(child.stderr, report, lock), daemon=True)
    reader.start()
    first = []  # when the first request came

    def forward(signum, frame):
        # The first request: a stop every rank checkpoints. Another, later: mpirun's own, at once. Within
        # SAME_REQUEST_SECONDS it is the same request arriving twice (as the ranks count it).
        if not first:
            first.append(time.monotonic())
            child.send_signal(signal.SIGUSR1)
        elif time.monotonic() - first[0] > SAME_REQUEST_SECONDS:
            child.send_signal(signal.SIGTERM)

    for signum in STOP_SIGNALS:
        signal.signal(signum, forward)
    status = child.wait()
    reader.join(DRAIN_SECONDS)
    with lock:
        report.close()
    sys.exit(status if status >= 0 else 128 - status)


if __name__ == "__main__":
    main()
