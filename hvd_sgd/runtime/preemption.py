"""A signal becomes a clean stop: the batch system's warning before a time limit, preemption,
scancel, Ctrl-C.

SIGTERM, SIGUSR1 or SIGINT to any rank sets that rank's stop request. After about
CHECK_EVERY_SECONDS of steps the ranks all-reduce their requests (Max), so all see it after the
same step: rank 0 checkpoints exactly that step and every rank ends with ``cli.Stopped`` (exit
status ``cli.EXIT_STOPPED``). A second signal, or a stop still unfinished after ``grace`` seconds (a rank gone,
a collective that never ends), exits the process at once: the previous checkpoint stays the latest.

``listen`` starts catching the signals; call it as early as possible (``hvd_sgd.train.main``
does, before Horovod starts and the data loads): until then a signal has its default action and
ends the process. A request made during start-up stops the run at its first check.
"""
import os
import signal
import socket
import sys
import threading
import time

import tensorflow as tf

from hvd_sgd.runtime import SAME_REQUEST_SECONDS, announced

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# The ranks compare requests in an all-reduce of their own, between steps, after as many steps as
# take this long (every step, if one takes longer): an all-reduce after every short step would cost
# it a tenth or more of its time (docs/design.md, "The stop check"); a stop comes within a fraction of a second.
CHECK_EVERY_SECONDS = 0.1


_listening = None


def listen(grace):
    """This process's StopRequest, catching the signals from the first call on (signals belong to
    the process, so there is one, whoever asks first). From the main thread."""
    global _listening
    if _listening is None:
        _listening = StopRequest(grace)._install()
    return _listening


class StopRequest:
    def __init__(self, grace):
        self.grace = grace
        self.signal = None

    def _install(self):
        """The signals are acted on by a thread of their own (through Python's wake-up fd), which
        runs even while the main thread waits in a collective."""
        self._wakeup = socket.socketpair()
        self._wakeup[1].setblocking(False)
        signal.set_wakeup_fd(self._wakeup[1].fileno())
        for signum in SIGNALS:
            signal.signal(signum, lambda *_: None)
        threading.Thread(target=self._watch, name="hvd_sgd-signals", daemon=True).start()
        return self

    def _watch(self):
        while True:
            for signum in self._wakeup[0].recv(64):
                if signum in SIGNALS:
                    self._on_signal(signum)

    def agreed(self, seconds_per_step):
        """Whether any rank has been signalled, and in how many steps to ask again: the same on
        every rank. Between steps, after the same step on every rank: with several ranks, one
        all-reduce (Max) of the requests and of each rank's ``seconds_per_step`` (0: not known yet)."""
        import horovod.tensorflow as hvd
        mine = [float(self.signal is not None), seconds_per_step]
        requested, slowest = (hvd.allreduce(tf.constant(mine), op=hvd.Max, name="stop_request").numpy()
                              if hvd.size() > 1 else mine)
        return bool(requested > 0), max(1, round(CHECK_EVERY_SECONDS / slowest)) if slowest > 0 else 1

    def _on_signal(self, signum):
        if self.signal is not None and time.monotonic() - self.first_at < SAME_REQUEST_SECONDS:
            return
        if self.signal is not None:  # a second request: now
            _exit_now(f"second signal ({signal.Signals(signum).name}): exiting without a checkpoint", signum)
        self.signal, self.first_at = signal.Signals(signum).name, time.monotonic()
        if announced.is_chief():  # one line for the job's log, at once: the stop itself may take a while
            sys.stdout.write(f"hvd_sgd: {self.signal} received: stopping after the next check of the ranks\n")
            sys.stdout.flush()
        timer = threading.Timer(self.grace, _exit_now, (f"the stop took over {self.grace:.0f} s: exiting without "
                                                        f"a checkpoint", signum))
        timer.daemon = True
        timer.start()


def _exit_now(message, signum):
    sys.stderr.write(f"hvd_sgd: {message}\n")
    sys.stderr.flush()
    os._exit(128 + signum)
