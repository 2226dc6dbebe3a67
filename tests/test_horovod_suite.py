"""Horovod's own TensorFlow tests (v0.28.1, tests/horovod/) against the installation's patched
Horovod, on 2 ranks under its mpirun: every collective, process sets, grouped operations, the Keras
wrapper and its callbacks, with hvd_sgd's patch of the background thread and hvd_sgd's 0-ms cycle.
On the current stack, a test whose own code calls what Keras 3 removed (or NumPy 2 changed) runs as
its port (tests/horovod/parallel/test_keras3_ports.py, each with its reason) in its place. Nothing
may fail, on either rank; the launcher must exit 0; each file must pass at least the tests it passed
when measured, so that a file that collects or runs nothing fails. run/test runs it on the current
stack; on the keras2 stack, whose Horovod is as released but for the two patches both share, by hand:
`.venv-keras2/bin/python -m pytest -m horovod_suite`."""
import hashlib
import subprocess
import xml.etree.ElementTree as ElementTree

import pytest

from conftest import ROOT, STACK
from hvd_sgd.bench import launchers

pytestmark = [pytest.mark.horovod_suite, pytest.mark.slow]
SUITE = ROOT / "tests" / "horovod"
PORTS = "test_keras3_ports.py"
# Each vendored file's test class, and its tests that the ports replace on the current stack.
CLASSES = {"test_tensorflow.py": "TensorFlowTests", "test_tensorflow2_keras.py": "Tf2KerasTests",
           "test_tensorflow_process_sets.py": "TensorFlowProcessSetsTests"}
PORTED = {
    "test_tensorflow.py": ("test_horovod_syncbn_cpu", "test_partial_distributed_gradient_tape"),
    "test_tensorflow2_keras.py": (
        "test_train_model_lr_schedule", "test_sparse_as_dense", "test_legacy_optimizer",
        "test_sparse_as_dense_with_grad_aggregation", "test_grad_aggregation_with_inf_grad",
        "test_gradient_aggregation_0", "test_gradient_aggregation_1", "test_gradient_aggregation_with_local_vars_0",
        "test_gradient_aggregation_with_local_vars_1", "test_partial_distributed_optimizer",
        "test_broadcast_global_variables_callback_with_local_vars"),
    "test_tensorflow_process_sets.py": ("test_horovod_reducescatter_grad_cpu_process_sets",),
}
# The tests each file passed on each rank on 2026-12-07 (AMD Zen 3, 2 ranks, the CPU).
AT_LEAST_PASSED = {
    ("test_tensorflow.py", "current"): 84, ("test_tensorflow.py", "keras2"): 86,
    ("test_tensorflow2_keras.py", "current"): 2, ("test_tensorflow2_keras.py", "keras2"): 13,
    ("test_tensorflow_process_sets.py", "current"): 22, ("test_tensorflow_process_sets.py", "keras2"): 23,
    (PORTS, "current"): 13,
}


def test_the_vendored_files_are_horovods_own():
    for line in (SUITE / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((SUITE / name).read_bytes()).hexdigest() == digest, name


def outcomes(report):
    """{test name: "passed" | "failed" | "skipped"} from a JUnit XML report."""
    result = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        result[case.get("name")] = ("failed" if kinds & {"failure", "error"} else
                                    "skipped" if "skipped" in kinds else "passed")
    return result


@pytest.mark.parametrize("name", [*CLASSES, PORTS])
def test_horovods_own_tests_pass_on_the_patched_build(name, tmp_path):
    if (name, STACK) not in AT_LEAST_PASSED:
        pytest.skip("the ports are Keras 3's: on the default (Keras 2) stack the originals run")
    reports = tmp_path / "reports"
    reports.mkdir()
    path = SUITE / "parallel" / name
    # Deselected by node id, which pytest names from the repository's root (setup.cfg).
    ported = [f"--deselect={path.relative_to(ROOT)}::{CLASSES[name]}::{test}"
              for test in PORTED.get(name, ())] if STACK == "current" else []
    # Each rank runs pytest on the file (as Horovod's CI does), on the CPU, with hvd_sgd's 0-ms cycle.
    each_rank = ("sh", "-c", f'exec "$@" --junitxml={reports}/rank-$OMPI_COMM_WORLD_RANK.xml', "sh")
    command = launchers.command("mpirun", 2, "pytest", ["-q", "-p", "no:cacheprovider", "--rootdir", ROOT, "-k", "not gpu",
                                                        *ported, path],
                                before_program=each_rank)
    run = subprocess.run(command, cwd=SUITE / "parallel", env=launchers.environment(HOROVOD_CYCLE_TIME="0"),
                         capture_output=True, text=True, timeout=1500)
    for rank in range(2):
        outcome = outcomes(reports / f"rank-{rank}.xml")
        failed = sorted(test for test, result in outcome.items() if result == "failed")
        passed = sum(result == "passed" for result in outcome.values())
        assert not failed, f"rank {rank} failed: {failed}"
        assert passed >= AT_LEAST_PASSED[name, STACK], f"rank {rank} passed {passed} tests"
    assert run.returncode == 0, run.stdout[-3000:]
