"""The package's shape (docs/design.md, "The package in rooms"): rooms that import one way, the
launcher's environment read in the runtime alone, data formats known in the data room alone, the
recipe readable in ``fit``, README's layout naming every module, and every module importing on its
own. No process starts."""
import ast
import importlib
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hvd_sgd"
README = PACKAGE.parent / "README.md"
REFERENCE = PACKAGE.parent / "docs" / "reference.md"
# Each room may import the rooms after it in its line, and the package's root (JobError, first_line).
ROOM_IMPORTS = {
    "runtime": set(),
    "data": {"runtime"},
    "training": {"data", "runtime"},
    "top": {"config", "data", "runtime", "training"},  # train, train_v1
    "config": set(),
    "bench": {"config", "data", "runtime", "training", "top"},
}
FORMAT_MODULES = ("catalogs", "streams", "shared_data", "augment", "convert")
LAUNCHER_VARIABLES = re.compile(r"OMPI_COMM|OMPI_VERSION|PMIX_RANK|PMI_RANK|PMI_SIZE|HOROVOD_RANK|HOROVOD_SIZE|"
                                r"HOROVOD_LOCAL|HOROVOD_ELASTIC|SLURM_")


def modules():
    """{dotted name: path} of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def room(module):
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] in ("data", "runtime", "training", "bench"):
        return parts[1]
    return "config" if parts[1] == "config" else "top"


def imports(path):
    """The package's modules that ``path`` imports, inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hvd_sgd"):
            names |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("hvd_sgd")}
    known = modules()
    return {name for name in names if name in known}


def test_rooms_import_one_way():
    wrong = []
    for module, path in modules().items():
        for imported in imports(path):
            if room(imported) not in ROOM_IMPORTS.get(room(module), set()) | {room(module), "root"}:
                wrong.append(f"{module} imports {imported}")
    assert not wrong, wrong


def test_no_import_circle():
    """Imports inside functions count too: one that breaks a circle only hides it."""
    graph = {module: imports(path) for module, path in modules().items()}

    def reaches(start, target, seen):
        for nxt in graph[start]:
            if nxt == target or (nxt not in seen and (seen.add(nxt) or reaches(nxt, target, seen))):
                return True
        return False

    circles = [module for module in graph if reaches(module, module, set())]
    assert not circles, circles


def test_the_launchers_environment_is_read_in_the_runtime_alone():
    readers = [module for module, path in modules().items()
               if room(module) != "runtime" and LAUNCHER_VARIABLES.search(path.read_text())]
    assert not readers, readers


def test_data_formats_are_known_in_the_data_room_alone():
    # The bench writes the input suite's image sets with convert: the one exception.
    allowed = {("hvd_sgd.bench.workers", "hvd_sgd.data.convert")}
    wrong = [(module, imported) for module, path in modules().items() if room(module) != "data"
             for imported in imports(path) if imported.rsplit(".", 1)[-1] in FORMAT_MODULES]
    assert set(wrong) <= allowed, wrong


def test_fit_reads_in_under_60_lines():
    tree = ast.parse((PACKAGE / "train.py").read_text())
    fit = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "fit")
    assert fit.end_lineno - fit.lineno + 1 < 60


def test_the_quick_tier_fails_a_test_that_starts_a_process():
    """conftest's guard, which keeps the quick tier (-m "not slow") free of processes: in a test not
    marked slow, starting one fails the test."""
    import subprocess
    with pytest.raises(pytest.fail.Exception, match="starts a process: mark it slow"):
        subprocess.run(["true"])


def test_readmes_layout_names_every_module_in_its_room():
    """README's layout: a tree of the rooms, a line each, that names every module on its room's line."""
    section = README.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    tree = section.split("```", 2)[1]
    lines = {re.match(r"[│├└─\s]*(\S+)", line).group(1): line for line in tree.splitlines()[1:] if line.strip()}
    missing = []
    for module, path in modules().items():
        parts = module.split(".")[1:]
        if not parts or (len(parts) == 2 and parts[1] in ("__main__",)):
            continue
        if len(parts) == 1:
            entry = parts[0] + ("/" if path.name == "__init__.py" else ".py")
            if entry not in lines:
                missing.append(entry)
        elif not re.search(rf"\b{parts[1]}\b", lines.get(parts[0] + "/", "")):
            missing.append(module)
    named = {name for entry, line in lines.items() if entry.endswith("/") for name in re.findall(r"`(\w+)`", line)}
    ghosts = [name for name in named if not any(module.endswith("." + name) for module in modules())]
    assert not missing and not ghosts, (missing, ghosts)


def test_every_module_imports_on_its_own():
    """The quick tier imports every module, the ones that run only in the slow tier's processes too
    (the bench's workers; a program's __main__ would run it)."""
    for module in modules():
        if not module.endswith("__main__"):
            importlib.import_module(module)


def test_every_readme_claim_in_the_coverage_table_is_the_readmes_and_names_tests_that_exist():
    """docs/reference.md's table of claims: each claim is the README's own words, and each row names
    tests that exist (file::function; one not in CI says so, with its command), or says "not in CI"
    and cites records (benchmarks/) that exist."""
    words = lambda text: " ".join(text.replace("\\|", "|").split())
    readme = words(README.read_text())
    text = REFERENCE.read_text()
    rows = text[text.index("<!-- claims:"):text.index("<!-- end of claims -->")].splitlines()[3:]
    tests = {f"{path.name}::{node.name}" for path in README.parent.joinpath("tests").glob("test_*.py")
             for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
    assert len(rows) > 20
    for row in rows:
        claim, checked_by = (cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:3])
        assert words(claim) in readme, f"not in the README: {claim}"
        named = re.findall(r"`(test_\w+\.py::\w+)`", checked_by)
        assert set(named) <= tests, f"no such test: {set(named) - tests}"
        records = re.findall(r"\]\(\.\./(benchmarks/[^)]+)\)", checked_by)
        missing = [record for record in records if not (README.parent / record).exists()]
        assert not missing, f"no such record: {missing}"
        assert named or ("not in CI" in checked_by and records), row
