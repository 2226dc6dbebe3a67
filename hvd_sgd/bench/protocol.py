"""How a contender reports to the bench: its chief prints one line ``BENCH {json}`` on stdout.

The bench starts workers as ``python -m hvd_sgd.bench worker KIND ARG…`` (see ``workers``),
under whatever launcher the contender needs, and reads those lines from their output.
"""
import json
import sys

PREFIX = "BENCH "


def worker_args(kind, *args):
    """The arguments of ``python -m hvd_sgd.bench`` that run worker ``kind``."""
    return ["worker", kind, *map(str, args)]


def report(result):
    print(PREFIX + json.dumps(result), flush=True)


def results(stdout):
    """Every result reported in a process's output (launchers may prefix lines with a rank tag)."""
    return [json.loads(line.split(PREFIX, 1)[1]) for line in stdout.splitlines() if PREFIX + "{" in line]


def parse_worker_args(argv):
    """``worker KIND ARG…`` -> (KIND, [ARG…]) with integer arguments as ints."""
    return argv[1], [int(a) if a.isdigit() else a for a in argv[2:]]


def is_worker(argv=None):
    return (sys.argv[1:] if argv is None else argv)[:1] == ["worker"]
