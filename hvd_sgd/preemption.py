"""A signal becomes a clean stop: the batch system's warning before a time limit, preemption,
scancel, Ctrl-C.

SIGTERM, SIGUSR1 or SIGINT to any rank sets that rank's stop request. Every CHECK_EVERY_STEPS
training steps the ranks all-reduce their requests (Max, beside the gradients), so all see it
after the same step: rank 0 checkpoints exactly that step and every rank ends with ``Stopped`` (exit status
EXIT_STOPPED). A second signal, or a stop still unfinished after ``grace`` seconds (a rank gone,
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

from hvd_sgd import JobError, startup

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, to be continued; not a failure (that is 1)
# One request often arrives twice: Ctrl-C reaches the launcher and the ranks, and mpirun forwards
# SIGUSR1 to ranks that got it from the batch system too. Within this window it is the same request.
SAME_REQUEST_SECONDS = 1.0
# An all-reduce costs about 0.1 ms here, a tenth of a softmax step: the ranks compare requests
# every few steps (the stop comes at most this many steps later).
CHECK_EVERY_STEPS = 10


class Stopped(JobError):
    """The run stopped on a signal, after a checkpoint of its last step if it has a directory."""


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
        self._flag = None
        self._lock = threading.Lock()

    def ready(self):
        """From ``fit``, once start-up has set TensorFlow's thread counts (the first variable fixes
        them) and before the step is compiled: the request becomes a variable that the compiled
        step reads, set already if a signal came during start-up."""
        with self._lock:
            if self._flag is None:
                self._flag = tf.Variable(1.0 if self.signal else 0.0, trainable=False, name="stop_request")
        return self

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

    @tf.autograph.experimental.do_not_convert
    def agreed(self, step):
        """In the compiled step: True on every rank, after the same step, once any rank has been
        signalled. One rank alone needs no all-reduce; several all-reduce the requests every
        CHECK_EVERY_STEPS steps (every rank is at the same step, so all take part or none).
        Its branch on a tensor is a tf.cond, so autograph is off: it would only convert Horovod's
        all-reduce, seconds of each rank's first step (docs/benchmarks.md, "Start-up")."""
        import horovod.tensorflow as hvd
        if hvd.size() == 1:
            return self._flag.read_value() > 0
        return tf.cond(step % CHECK_EVERY_STEPS == 0,
                       lambda: hvd.allreduce(self._flag.read_value(), op=hvd.Max, name="stop_request") > 0,
                       lambda: tf.constant(False))

    def _on_signal(self, signum):
        if self.signal is not None and time.monotonic() - self.first_at < SAME_REQUEST_SECONDS:
            return
        if self.signal is not None:  # a second request: now
            _exit_now(f"second signal ({signal.Signals(signum).name}): exiting without a checkpoint", signum)
        with self._lock:
            self.signal, self.first_at = signal.Signals(signum).name, time.monotonic()
            if self._flag is not None:
                self._flag.assign(1.0)
        if startup.launch_rank() == 0:  # one line for the job's log, at once: the stop itself may take a while
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
