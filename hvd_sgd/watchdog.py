"""The stall watchdog: a frozen rank must end the job, not hang it for hours.

A rank that dies is noticed by the launcher, which ends the job. A rank that is alive but stuck
(SIGSTOP, a hung file system, a wedged driver) is not: every other rank waits in the next
all-reduce for ever, and Horovod's own stall check cannot run because its coordination waits
for that rank too. So each rank runs a thread that

- beats: every second it writes the rank's last finished step to a heartbeat file
  (``$HVD_SGD_HEARTBEAT_DIR``, default the temporary directory: set it to shared storage for
  multi-node jobs to have the frozen rank named);
- watches: when no step has finished for ``timeout`` seconds, it names the ranks whose heartbeat
  stopped (a frozen process stops beating), prints one line (the lowest live rank does), and
  exits the process with status 1, which makes the launcher end the job.
"""
import atexit
import os
import shutil
import sys
import tempfile
import threading
import time

BEAT_SECONDS = 1.0


class Watchdog:
    def __init__(self, world, timeout):
        """``timeout`` None: a watchdog that watches nothing (elastic mode handles lost workers)."""
        self.world, self.timeout = world, timeout
        root = os.environ.get("HVD_SGD_HEARTBEAT_DIR") or tempfile.gettempdir()
        self.directory = os.path.join(root, f"hvd_sgd-heartbeat-{world.job_token}")
        self.step, self.last_progress = 0, time.monotonic()

    def start(self):
        """From here to the end of the process; the heartbeat files go at exit."""
        if self.timeout is not None:
            os.makedirs(self.directory, exist_ok=True)
            atexit.register(shutil.rmtree, self.directory, ignore_errors=True)
            threading.Thread(target=self._run, name="hvd_sgd-watchdog", daemon=True).start()
        return self

    def progress(self, step=None):
        """Called after every training step, and after each phase of the start-up."""
        self.step, self.last_progress = self.step if step is None else step, time.monotonic()

    def _run(self):
        while True:
            time.sleep(BEAT_SECONDS)
            self._beat()
            if time.monotonic() - self.last_progress > self.timeout:
                self._fire()

    def _beat(self):
        path = os.path.join(self.directory, f"rank-{self.world.rank}")
        try:
            with open(path + ".tmp", "w") as f:
                f.write(str(self.step))
            os.replace(path + ".tmp", path)
        except OSError:
            pass  # the directory went away at the end of the job

    def _fire(self):
        now = time.time()
        frozen = []
        for rank in range(self.world.size):
            try:
                age = now - os.path.getmtime(os.path.join(self.directory, f"rank-{rank}"))
            except OSError:
                age = None  # not visible from this node
            if age is None or age > max(3 * BEAT_SECONDS, self.timeout / 4):
                frozen.append(rank)
        alive = [r for r in range(self.world.size) if r not in frozen]
        # The lowest live rank reports. A rank that was itself frozen (its own heartbeat is stale)
        # and is woken by the launcher's SIGCONT before its SIGTERM says nothing.
        if alive and self.world.rank == alive[0]:
            who = (f"rank(s) {', '.join(map(str, frozen))} stopped responding" if frozen
                   else "no rank stopped responding, but a collective operation is blocked")
            sys.stderr.write(f"hvd_sgd: error: no training step finished for {self.timeout:.0f} s after step "
                             f"{self.step}: {who}; ending the job (--stall-timeout)\n")
            sys.stderr.flush()
        else:
            time.sleep(2)  # let the reporting rank speak before the launcher tears the job down
        os._exit(1)
