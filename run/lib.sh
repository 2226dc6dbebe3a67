# Shared by the run/ scripts: paths, the stack and the Debian-package helper. Source it; do not run it.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}

say() { echo "[hvd_sgd] $*" >&2; }
die() { echo "[hvd_sgd] error: $*" >&2; exit 1; }

# Two stacks (docs/guide.md, "Two stacks"): current, the default, the newest TensorFlow with Keras 3
# and Horovod patched for it, in .venv; keras2, TensorFlow 2.15 with Keras 2 (HVD_SGD_STACK=keras2),
# in .venv-keras2. Unless HVD_SGD_STACK names one, the Python picks: TensorFlow 2.21 needs 3.10 or later.
python_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
    die "no Python at PYTHON=$PYTHON: set PYTHON to a Python 3.9 to 3.13"
if [ -z "${HVD_SGD_STACK:-}" ]; then
    case $python_version in
        3.10|3.11|3.12|3.13) STACK=current ;;
        3.9) STACK=keras2
            say "$PYTHON is Python 3.9: the keras2 stack (TensorFlow 2.15, Keras 2), in .venv-keras2; the current stack's TensorFlow 2.21 needs Python 3.10 to 3.13" ;;
        *) die "$PYTHON is Python $python_version: hvd_sgd needs Python 3.10 to 3.13 (or 3.9 with HVD_SGD_STACK=keras2); set PYTHON to one" ;;
    esac
    export HVD_SGD_STACK=$STACK  # picked once: the scripts these start keep it, and say nothing
else
    STACK=$HVD_SGD_STACK
fi
case $STACK in
    current) VENV=${HVD_SGD_VENV:-$ROOT/.venv} ;;
    keras2) VENV=${HVD_SGD_VENV:-$ROOT/.venv}-keras2 ;;
    *) die "HVD_SGD_STACK=$STACK: choose current (the default) or keras2" ;;
esac
# Debian packages can be installed here: apt and dpkg, and root or sudo without a password.
can_install_debian() {
    command -v apt-get >/dev/null && command -v dpkg-query >/dev/null &&
        { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }
}

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif sudo -n true 2>/dev/null; then sudo -n "$@"; else
        die "need root (or sudo) to run: $*"; fi
}

# ensure_debian_packages PKG...: install those not installed yet (apt-get update only if needed).
ensure_debian_packages() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing Debian packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
