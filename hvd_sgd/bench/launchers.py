"""Start hvd_sgd the way users do: plain python, mpirun, horovodrun (over MPI or Gloo).

One place for the command lines and the environment, used by the benchmark and the tests.
"""
import contextlib
import os
import shutil
import sys

LAUNCHERS = ("python", "mpirun", "horovodrun", "horovodrun-gloo")
_python = sys.executable  # the installation whose hvd_sgd is launched: this one, unless using_python says


@contextlib.contextmanager
def using_python(python):
    """Launch another installation's hvd_sgd (its Python, its horovodrun) inside this block: the
    benchmark's stacks suite runs both stacks (docs/guide.md, "Two stacks") side by side."""
    global _python
    saved, _python = _python, python
    try:
        yield
    finally:
        _python = saved


@contextlib.contextmanager
def environment_variable(name, value):
    """``os.environ[name]`` is ``value`` (None: unset) inside this block, and so in the environment of
    what it launches; as it was after. The benchmark's lever suite runs without and with one."""
    saved = os.environ.get(name)
    _set_variable(name, value)
    try:
        yield
    finally:
        _set_variable(name, saved)


def _set_variable(name, value):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def environment(**extra):
    """This environment, plus what Open MPI needs to start as root, and unbuffered output; ``extra`` wins."""
    return {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def command(launcher, np_, module, args=(), before_program=(), hosts=None):
    """``python -m module args`` on ``np_`` ranks under ``launcher`` (one of LAUNCHERS).

    ``before_program`` (mpirun only): mpirun options, or a wrapper command, placed before the program.
    ``hosts``: the ranks' hosts, as ``-H`` takes them (``node1:2,node2:2``); none: this host.
    """
    program = [_python, "-m", module, *map(str, args)]
    if launcher == "python":
        assert np_ == 1 and not hosts, "plain python runs one rank, here"
        return program
    if launcher == "mpirun":
        # mpirun passes its environment to the ranks on its own host only: -x to the others.
        across = ["-H", hosts, "-x", "PYTHONUNBUFFERED"] if hosts else []
        return [mpirun(), "-np", str(np_), "--oversubscribe", *across, *before_program, *program]
    across = ["-H", hosts] if hosts else []
    gloo = ["--gloo"] if launcher == "horovodrun-gloo" else []
    return [venv_bin("horovodrun"), "-np", str(np_), *across, *gloo, *program]


def mpirun():
    """The installation's mpirun (run/setup puts it beside the Python: the MPI's own, with hvd_sgd's
    defaults, hvd_sgd/mpirun.py); the PATH's where there is none."""
    beside = venv_bin("mpirun")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpirun")


def venv_bin(name):
    """A program installed beside the launched Python (horovodrun comes with Horovod)."""
    return os.path.join(os.path.dirname(_python), name)
