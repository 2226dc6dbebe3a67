"""A dated record of a bench run, and the README's results table made from it.

``python -m hvd_sgd.bench --record`` copies the run's results.md, results.json and plots into
``benchmarks/<date>-<suites>-<machine type>/`` (``default`` for the default suites) with
``lscpu``'s output beside them, adds the record's line to the index (benchmarks/README.md), and,
when the run has the suites the table reads (tta, scaling, peer), rewrites the README's table
between its markers.
"""
import datetime
import glob
import os
import shutil
import subprocess

from hvd_sgd.bench.suites import DEFAULT_SUITES

TABLE_BEGIN, TABLE_END = "<!-- results table: written by python -m hvd_sgd.bench --record -->", "<!-- end of results table -->"
TABLE_SUITES = ("tta", "scaling", "peer")
INDEX_BEGIN, INDEX_END = "<!-- records: a line each, added by python -m hvd_sgd.bench --record -->", "<!-- end of records -->"


def machine_type(cpuinfo="/proc/cpuinfo"):
    """A short name for this CPU: AMD's Zen generations by family and model, else vendor-family-model."""
    fields = {}
    with open(cpuinfo) as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    vendor, family, model = fields.get("vendor_id", "cpu"), int(fields.get("cpu family", 0)), int(fields.get("model", 0))
    if vendor == "AuthenticAMD":
        zen4 = model >> 4 in (0x1, 0x6, 0x7, 0xa)  # family 25: Genoa, Phoenix, Raphael, Bergamo; the rest Zen 3
        zen = {26: "zen5", 25: "zen4" if zen4 else "zen3", 23: "zen2"}.get(family)
        if zen:
            return zen
    return f"{'intel' if vendor == 'GenuineIntel' else vendor.lower()}-{family}-{model}"


def cpu_name(cpuinfo="/proc/cpuinfo"):
    """The CPU's model name, as lscpu prints it."""
    with open(cpuinfo) as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "a CPU")


def record_name(results, today=None):
    """``<date>-<suites>-<machine type>``, ``-quick`` after a quick run: what ran, and where."""
    suites = list(results["suites"])
    what = "default" if suites == list(DEFAULT_SUITES) else "+".join(suites)
    return f"{today or datetime.date.today().isoformat()}-{what}-{machine_type()}{'-quick' if results['quick'] else ''}"


def write(results, results_dir, records_dir, today=None):
    """The record's directory: the run's files and lscpu, under ``records_dir``, and its line in the
    index, ``records_dir``/README.md, where that has one."""
    name = record_name(results, today)
    directory = os.path.join(records_dir, name)
    suffix = 1
    while os.path.exists(directory):  # a second run the same day on the same type
        suffix += 1
        directory = os.path.join(records_dir, f"{name}-{suffix}")
    os.makedirs(directory)
    for path in [os.path.join(results_dir, "results.md"), os.path.join(results_dir, "results.json"),
                 *glob.glob(os.path.join(results_dir, "*.png"))]:
        shutil.copy(path, directory)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    with open(os.path.join(directory, "lscpu.txt"), "w") as f:
        f.write(lscpu)
    _index(os.path.join(records_dir, "README.md"), f"- [{os.path.basename(directory)}]({os.path.basename(directory)}/results.md): "
           f"`--suites {','.join(results['suites'])}`{' --quick' if results['quick'] else ''}, {cpu_name()}")
    return directory


def _index(readme, line):
    """``line`` added last to the index between its markers (none: nothing written)."""
    if not os.path.exists(readme):
        return
    with open(readme) as f:
        text = f.read()
    if INDEX_END not in text:
        return
    with open(readme, "w") as f:
        f.write(text.replace(INDEX_END, f"{line}\n{INDEX_END}"))


def results_table(results, record):
    """The README's results table: time to 99 %, scaling against the no-all-reduce ceiling, and the
    peers, with the machine and date in one line."""
    suites, tta = results["suites"], results["suites"]["tta"]

    def to_target(name):
        seconds = tta[name]["to_target"]
        return f"{seconds:.1f} s" if seconds else "not reached"
    target = next(iter(tta.values()))["target"]
    lines = [TABLE_BEGIN,
             f"Measured {os.path.basename(record)[:10]} on {cpu_name()} ({machine_type()}, {results['machine']['cores']} "
             f"cores), "
             f"{results['rounds']} alternating rounds a ratio: [{os.path.basename(record)}]"
             f"(benchmarks/{os.path.basename(record)}/results.md).", "",
             "| what | hvd_sgd | against |", "| --- | --- | --- |",
             f"| time to {target:.0%} test accuracy, default recipe | 2 ranks {to_target('hvd_sgd_np2')}, "
             f"1 rank {to_target('hvd_sgd_np1')} | plain Keras, one process: {to_target('keras')} |"]
    lines += [f"| `{model}`, 2 ranks: scaling | {row['ratio']:.2f} | two 1-rank runs with no all-reduce: 1.00 |"
              for model, row in suites["scaling"].items()]
    lines += [f"| `{model}`, 2 ranks: speed | {row['ratio']:.2f}× | MultiWorkerMirroredStrategy, 2 workers: 1× |"
              for model, row in suites["peer"].items()]
    return lines + [TABLE_END]


def update_readme(readme, table):
    """Replace the table between the README's markers; False if it has none."""
    with open(readme) as f:
        text = f.read()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return False
    before, rest = text.split(TABLE_BEGIN, 1)
    after = rest.split(TABLE_END, 1)[1]
    with open(readme, "w") as f:
        f.write(before + "\n".join(table) + after)
    return True
