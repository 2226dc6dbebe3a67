"""The stall watchdog: a frozen rank must end the job, not hang it for hours.

A rank that dies is noticed by the launcher, which ends the job. A rank that is alive but stuck
(SIGSTOP, a hung file system, a wedged driver) is not: every other rank waits in the next
all-reduce for ever, and Horovod's own stall check cannot run because its coordination waits
for that rank too. So each rank runs a thread that

- beats: every second it writes the rank's last finished step, the seconds since its last progress,
  its host and the files it works in (if it does) to a heartbeat file, in a directory every node
  sees (see ``heartbeat_root``);
- watches: when its rank has made no progress for ``timeout`` seconds, nor rank 0 (which writes
  checkpoints alone while the others wait for it), and no rank is in a graph's first call (``tracing``:
  a trace and compile may take minutes, ended only after ``trace_timeout``) with every rank beating, it names the ranks whose heartbeat
  stopped (a frozen process stops beating; a stopped one is said to be), or else those stuck in
  their files (a hung file system), and their hosts, prints one line (the lowest live rank does),
  and exits the process with status 1, which makes the launcher end the job. Before that every
  live rank writes all its threads' Python stacks to a file of the job's stacks directory, which
  the line names: where each rank was waiting;
- listens: every beat, each rank and rank 0 send each other a datagram (``_Link``). A node cut off
  from the network stops them at once, long before a stalled step says so: after
  ``unreachable_after()`` seconds of silence, rank 0 names the ranks it lost and their hosts, and a
  rank that lost rank 0 leaves (docs/design.md, "Launchers").
"""
import atexit
import collections
import contextlib
import faulthandler
import glob
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time

BEAT_SECONDS = 1.0
# Silence on the link that means a node is cut off. Open MPI's mpirun ends such a job itself (its
# daemons' keepalive, 25 s with hvd_sgd's mpirun): a rank that left first would set it waiting on
# the lost node for many minutes, so under mpirun the link waits longer than that.
UNREACHABLE_SECONDS, UNREACHABLE_SECONDS_UNDER_MPIRUN = 15, 40
# Read a long file in chunks of this size: each read moves the file's position, which
# ``Watchdog.file_work`` counts as progress (one read of the whole file moves it once, at the end).
READ_CHUNK = 8 << 20
STALE_SECONDS = 24 * 3600  # a live job's heartbeat directory changes every second
# How long the reporting rank waits for the other live ranks' stacks: they look for the request at
# every beat.
STACKS_WAIT_SECONDS = 3 * BEAT_SECONDS

# A rank's heartbeat as another rank reads it: its age, the seconds that rank had then gone without
# progress, the seconds it had been tracing a graph (None if it was not), its host and process, and
# the files it was working in ("" if none).
Beat = collections.namedtuple("Beat", "age idle tracing host pid working_in")


def heartbeat_root():
    """``$HVD_SGD_HEARTBEAT_DIR``; else the cache in the home directory, which the nodes of a cluster
    share as they share the home itself (a node's /tmp is its own); else the temporary directory."""
    if os.environ.get("HVD_SGD_HEARTBEAT_DIR"):
        return os.environ["HVD_SGD_HEARTBEAT_DIR"]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                         "hvd_sgd")
    try:
        os.makedirs(cache, exist_ok=True)
        if os.access(cache, os.W_OK):
            return cache
    except OSError:
        pass
    return tempfile.gettempdir()


def remove_stale_heartbeats(root):
    """The heartbeat and stacks directories in ``root`` that have not changed for STALE_SECONDS: jobs
    that ended without removing theirs (a killed rank, a watchdog's own exit), and stacks read since."""
    for path in glob.glob(os.path.join(root, "hvd_sgd-heartbeat-*")) + glob.glob(os.path.join(root, "hvd_sgd-stacks-*")):
        try:
            if time.time() - os.path.getmtime(path) > STALE_SECONDS:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # another job's rank 0 removed it first


class Watchdog:
    def __init__(self, world, timeout, trace_timeout=None):
        """``timeout`` None: a watchdog that watches nothing (elastic mode handles lost workers).
        ``trace_timeout``: the seconds a graph's first call may take (None: ``timeout``)."""
        self.timeout, self.trace_timeout = timeout, trace_timeout or timeout
        self.rank, self.size, self.host = world.rank, world.size, socket.gethostname()
        self.step, self.last_progress = 0, time.monotonic()
        self.tracing_since = None  # when this rank's graph's first call began, while it runs
        self.working_in, self.file_state = None, None  # the files this rank works in, while it does; their state
        self.stopped = threading.Event()
        self.link = None
        self.stacks_written = False

    def start(self):
        """From here to ``stop()`` or the end of the process; the heartbeat files go at exit. A
        watchdog that watches nothing touches no directory. Starting one is a collective (the job's
        name)."""
        if self.timeout is not None:
            import horovod.tensorflow as hvd  # loaded by now: startup.start checked it
            job = hvd.broadcast_object(secrets.token_hex(8) if self.rank == 0 else None, root_rank=0)
            root = heartbeat_root()
            if self.rank == 0:  # one rank sweeps up after killed jobs (their atexit never ran)
                remove_stale_heartbeats(root)
            self.directory = os.path.join(root, f"hvd_sgd-heartbeat-{job}")
            # Beside it, kept after the job (the heartbeats go at exit): where a stalled job's stacks go.
            self.stacks_directory = os.path.join(root, f"hvd_sgd-stacks-{job}")
            os.makedirs(self.directory, exist_ok=True)
            self._beat()  # at once: a rank frozen before its thread's first beat is still named with its host
            atexit.register(shutil.rmtree, self.directory, ignore_errors=True)
            self.link = _Link(job, self.rank, self.size)
            threading.Thread(target=self._run, name="hvd_sgd-watchdog", daemon=True).start()
        return self

    def progress(self, step=None):
        """Called after every training step, after each phase of the start-up, and after each test
        batch of an evaluation."""
        self.step, self.last_progress = self.step if step is None else step, time.monotonic()

    @contextlib.contextmanager
    def file_work(self, path):
        """This rank reads or writes the file ``path`` or the files under it (data, a checkpoint),
        which may take longer than the timeout. The files growing, or this process's positions in
        them moving, is progress: a slow file system is no stall, a hung one is."""
        self.working_in = os.path.realpath(path)  # first: its file system may hang in the next line
        self.file_state = _file_state(self.working_in)
        try:
            yield
        finally:
            self.working_in = None
            self.progress()

    @contextlib.contextmanager
    def tracing(self, first_call=True):
        """A graph's first call (``first_call``): TensorFlow traces and optimizes the graph (XLA compiles it
        on a GPU), which for a large model can take minutes, and then waits in its first collective for
        the other ranks' traces. That, and the other ranks' wait for it, is no stall until
        ``trace_timeout``, while every rank beats: a rank that freezes meanwhile still ends the job
        within ``timeout``."""
        if not first_call:
            yield
            return
        self.tracing_since = time.monotonic()
        try:
            yield
        finally:
            self.tracing_since = None
            self.progress()

    def stop(self):
        """Stop watching: what is left, rank 0 writing its files, is no collective."""
        self.stopped.set()

    def _run(self):
        woke = time.monotonic()
        while not self.stopped.wait(BEAT_SECONDS):
            slept, woke = time.monotonic() - woke, time.monotonic()
            if slept > 3 * BEAT_SECONDS:
                # This process was stopped itself (a suspended job: scontrol suspend, gang
                # scheduling) or starved of CPU: no other rank's fault. The clocks start again.
                self.last_progress = woke
                if self.link:
                    self.link.heard_all(woke)
            path = self.working_in
            if path is not None and (state := _file_state(path)) != self.file_state:
                self.file_state, self.last_progress = state, woke
            self._beat()
            if not self.stacks_written and os.path.exists(os.path.join(self.directory, "reported")):  # the job ends
                self._write_stacks()
            if self.link:
                self.link.exchange()
                lost = self.link.silent_for(unreachable_after(), woke)
                if lost:
                    self._fire_unreachable(lost)
            if self.stalled(woke):
                self._fire()

    def stalled(self, now):
        """No progress on this rank for longer than the timeout, and none on rank 0 either (when it
        works alone, a checkpoint, this rank only waits for it), and no rank in a graph's first call
        within the trace timeout (this rank, or one it waits for), unless a rank's heartbeat stopped.
        Read only while this rank is idle, so mostly never."""
        if now - self.last_progress <= self.timeout or self._rank_0_progresses():
            return False
        beats = [self._heartbeat(rank) for rank in range(self.size)]
        return any(self._frozen(beat) for beat in beats) or not any(
            beat.tracing is not None and beat.tracing <= self.trace_timeout for beat in beats)

    def _frozen(self, beat):
        """Whether a heartbeat (None: never seen) says its rank stopped beating."""
        return beat is None or beat.age > max(3 * BEAT_SECONDS, self.timeout / 4)

    def _beat(self):
        path = os.path.join(self.directory, f"rank-{self.rank}")
        try:
            with open(path + ".tmp", "w") as f:
                tracing = "-" if self.tracing_since is None else f"{time.monotonic() - self.tracing_since:.1f}"
                f.write(f"{self.step} {time.monotonic() - self.last_progress:.1f} {tracing} {self.host} {os.getpid()} "
                        f"{self.working_in or ''}")
            os.replace(path + ".tmp", path)
        except OSError:
            pass  # the directory went away at the end of the job

    def _heartbeat(self, rank):
        """``rank``'s last Beat; None if it never beat or is not visible from this node."""
        path = os.path.join(self.directory, f"rank-{rank}")
        try:
            age = time.time() - os.path.getmtime(path)
            with open(path) as f:
                _, idle, tracing, host, pid, *working_in = f.read().split(" ", 5)
            return Beat(age, float(idle), None if tracing == "-" else float(tracing), host, int(pid), "".join(working_in))
        except (OSError, ValueError):
            return None

    def _rank_0_progresses(self):
        """Rank 0 beats and made progress within the timeout: it works alone (a checkpoint), and this
        rank waits for it. Read only while this rank is idle, so mostly never."""
        beat = None if self.rank == 0 else self._heartbeat(0)
        return beat is not None and beat.age <= 3 * BEAT_SECONDS and beat.idle <= self.timeout

    def _first_to_report(self):
        """Whether this rank is the first to report the job's end (one file, created once)."""
        try:
            os.close(os.open(os.path.join(self.directory, "reported"), os.O_CREAT | os.O_EXCL))
            return True
        except OSError:
            return False

    def _fire(self):
        frozen, stopped, stuck, tracing = {}, [], {}, []  # rank: host; stopped ranks; files: ["rank (host)", ...]; those
        for rank in range(self.size):
            beat = self._heartbeat(rank)
            if self._frozen(beat):
                frozen[rank] = beat.host if beat else "host unknown"
                if beat and beat.host == self.host and _stopped(beat.pid):
                    stopped.append(str(rank))
            elif beat.working_in:
                stuck.setdefault(beat.working_in, []).append(f"{rank} ({beat.host})")
            elif beat.tracing is not None and beat.tracing > self.trace_timeout:
                tracing.append(f"{rank} ({beat.host})")
        alive = [r for r in range(self.size) if r not in frozen]
        self._write_stacks()
        # The lowest live rank reports, unless a rank has reported already: it exits at once, and to
        # a rank that fires seconds later (it began waiting later) it looks frozen. A rank that was
        # itself frozen (its own heartbeat is stale) and is woken by the launcher's SIGCONT before
        # its SIGTERM says nothing.
        if alive and self.rank == alive[0] and self._first_to_report():
            if frozen:
                who = f"rank(s) {', '.join(f'{r} ({host})' for r, host in frozen.items())} stopped responding"
                if stopped:
                    who += f" (the process of rank(s) {', '.join(stopped)} is stopped: SIGSTOP, a debugger)"
            elif stuck:
                who = "; ".join(f"rank(s) {', '.join(ranks)} stuck in {files}" for files, ranks in stuck.items())
                who += " (a hung file system?)"
            elif tracing:
                who = (f"rank(s) {', '.join(tracing)} still in a graph's first call (its trace and compile, or its "
                       f"first collective) after {self.trace_timeout:.0f} s (--trace-timeout)")
            else:
                who = "no rank stopped responding, but a collective operation is blocked"
            sys.stderr.write(f"hvd_sgd: error: no training step finished for {self.timeout:.0f} s after step "
                             f"{self.step}: {who}; ending the job (--stall-timeout); {self._stacks_written(alive)}\n")
            sys.stderr.flush()
        else:
            time.sleep(2)  # let the reporting rank speak before the launcher tears the job down
        os._exit(1)

    def _write_stacks(self):
        """All this process's threads' Python stacks, once, into the job's stacks directory."""
        self.stacks_written = True
        path = os.path.join(self.stacks_directory, f"rank-{self.rank}.txt")
        with contextlib.suppress(OSError):  # a directory this node cannot write: the line says whose are missing
            os.makedirs(self.stacks_directory, exist_ok=True)
            with open(path, "x") as f:
                f.write(f"rank {self.rank} of {self.size}, host {self.host}, pid {os.getpid()}, after step {self.step}, "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)

    def _stacks_written(self, alive):
        """The reporting rank's words on the stacks: where they are, whose are missing. The other live
        ranks see the report (its file) at their next beat and write theirs."""
        deadline = time.monotonic() + STACKS_WAIT_SECONDS
        written = lambda: {r for r in alive if os.path.exists(os.path.join(self.stacks_directory, f"rank-{r}.txt"))}
        while written() != set(alive) and time.monotonic() < deadline:
            time.sleep(0.1)
        missing = sorted(set(range(self.size)) - written())
        return f"Python stacks in {self.stacks_directory}" + (
            f" (none from rank(s) {', '.join(map(str, missing))})" if missing else "")


    def _fire_unreachable(self, lost):
        """Rank 0 names the ranks it no longer hears and ends the job; a rank that no longer hears
        rank 0 (its own node cut off, or rank 0's) leaves without a word: it cannot be heard either."""
        if self.rank == 0 and self._first_to_report():
            hosts = {rank: (beat.host if (beat := self._heartbeat(rank)) else "host unknown") for rank in lost}
            sys.stderr.write(f"hvd_sgd: error: rank(s) {', '.join(f'{r} ({h})' for r, h in hosts.items())} silent "
                             f"for {unreachable_after():.0f} s after step {self.step} (a node cut off from the "
                             f"network, or a frozen process); ending the job\n")
            sys.stderr.flush()
        os._exit(1)


def _stopped(pid):
    """Whether process ``pid`` of this host is stopped (its state T, or t under a tracer)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def unreachable_after():
    """Seconds of silence on the link after which a rank is lost: longer under Open MPI's mpirun
    (its ranks carry OMPI_MCA_orte_hnp_uri), which ends such a job itself."""
    return UNREACHABLE_SECONDS_UNDER_MPIRUN if "OMPI_MCA_orte_hnp_uri" in os.environ else UNREACHABLE_SECONDS


class _Link:
    """A datagram every beat from each rank to rank 0, and from rank 0 to each rank, on this job's
    own UDP ports: what a node cut off from the network stops at once. Each rank's address is its
    host name's; a job across hosts whose names resolve only to loopback has no link. A peer is
    judged only once its first datagram has come: where a site's firewall drops them, the link
    stays silent from the start and judges no one."""

    def __init__(self, job, rank, size):
        import horovod.tensorflow as hvd
        self.token, self.rank = job.encode(), rank
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind(("", 0))
        self.socket.setblocking(False)
        host = socket.gethostname()
        try:
            address = socket.gethostbyname(host)
        except OSError:
            address = None
        peers = hvd.allgather_object((host, address, self.socket.getsockname()[1]))  # a collective
        hosts = {h for h, _, _ in peers}
        usable = all(a and (len(hosts) == 1 or not a.startswith("127.")) for _, a, _ in peers)
        ranks = range(1, size) if rank == 0 else [0]
        self.peers = {r: peers[r][1:] for r in ranks} if usable and size > 1 else {}
        self.heard = {}  # rank: when last heard, from its first datagram on

    def heard_all(self, now):
        self.heard = dict.fromkeys(self.heard, now)

    def exchange(self):
        """Read what came, then send this beat's datagrams."""
        while True:
            try:
                data = self.socket.recv(64)
            except (BlockingIOError, OSError):
                break
            token, _, sender = data.partition(b" ")
            if token == self.token and sender.isdigit() and int(sender) in self.peers:
                self.heard[int(sender)] = time.monotonic()
        for address in self.peers.values():
            try:
                self.socket.sendto(self.token + b" " + str(self.rank).encode(), address)
            except OSError:
                pass  # no route: the silence will tell

    def silent_for(self, seconds, now):
        """The ranks not heard from for ``seconds``."""
        return sorted(r for r, at in self.heard.items() if now - at > seconds)


def _file_state(path):
    """What changes as this process reads or writes the file ``path`` or the files under it: their
    sizes, and its positions in those it holds open."""
    files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names] \
        if os.path.isdir(path) else [path]
    sizes, positions = [], []
    for file in files:
        with contextlib.suppress(OSError):  # a temporary file renamed away meanwhile
            sizes.append(os.stat(file).st_size)
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target == path or target.startswith(path + os.sep):
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    positions.append(f.readline())  # "pos:\t<offset>"
    return sizes, positions
