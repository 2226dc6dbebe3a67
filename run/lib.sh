# Shared by the run/ scripts: paths and the Debian-package helper. Source it; do not run it.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Two stacks (docs/guide.md, "Two stacks"): default, TensorFlow 2.15 with Keras 2, in .venv; current, the
# newest TensorFlow with Keras 3 and a patched Horovod build, in .venv-current.
STACK=${HVD_SGD_STACK:-default}
case $STACK in
    default) VENV=${HVD_SGD_VENV:-$ROOT/.venv} ;;
    current) VENV=${HVD_SGD_VENV:-$ROOT/.venv}-current ;;
    *) echo "[hvd_sgd] error: HVD_SGD_STACK=$STACK: choose default or current" >&2; exit 2 ;;
esac

say() { echo "[hvd_sgd] $*" >&2; }
die() { echo "[hvd_sgd] error: $*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
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
