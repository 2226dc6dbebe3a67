"""Start hvd_sgd the way users do: plain python, mpirun, horovodrun (over MPI or Gloo).

One place for the command lines and the environment, used by the benchmark and the tests.
"""
import os
import shutil
import sys

LAUNCHERS = ("python", "mpirun", "horovodrun", "horovodrun-gloo")


def environment(**extra):
    """This environment, plus what Open MPI needs to start as root, and unbuffered output; ``extra`` wins."""
    return {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def command(launcher, np_, module, args=(), before_program=()):
    """``python -m module args`` on ``np_`` ranks under ``launcher`` (one of LAUNCHERS).

    ``before_program`` (mpirun only): mpirun options, or a wrapper command, placed before the program.
    """
    program = [sys.executable, "-m", module, *map(str, args)]
    if launcher == "python":
        assert np_ == 1, "plain python runs one rank"
        return program
    if launcher == "mpirun":
        return [shutil.which("mpirun"), "-np", str(np_), "--oversubscribe", *before_program, *program]
    gloo = ["--gloo"] if launcher == "horovodrun-gloo" else []
    return [venv_bin("horovodrun"), "-np", str(np_), *gloo, *program]


def venv_bin(name):
    """A program installed beside this Python (horovodrun comes with Horovod)."""
    return os.path.join(os.path.dirname(sys.executable), name)
