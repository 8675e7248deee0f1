#!/usr/bin/env bash
# Write amplification of the cleaner for uniform, 80/20 and Zipf traffic at 70/80/90% full, with
# the cleaner's moves on a cold head of their own and mixed with client writes, each next to the
# simulation of the same geometry (`cleaner-load`, one run per cell; steady-state figures).
#   SECS=45 POOL=2147483648 BENCH_DIR=/work/bench-wa bench/cleaner_wa.sh
# FILLS="80" and TRAFFIC="uniform zipf" run part of the matrix (each cell takes ~2 min).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-45}
POOL=${POOL:-2147483648}
DIR=${BENCH_DIR:-$PWD/bench-wa}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"
cargo build --workspace --locked --bin cleaner-load >&2
LOAD="$CARGO_TARGET_DIR/debug/cleaner-load"
trap 'rm -rf "$DIR"' EXIT
printf '%-8s %-5s %-6s %7s %9s   %s\n' traffic fill moves "WA" "WA last½" "simulation (greedy mixed / greedy separated / cost-benefit mixed / cost-benefit separated)"
for traffic in ${TRAFFIC:-uniform 80/20 zipf}; do
  for fill in ${FILLS:-70 80 90}; do
    for moves in cold mixed; do
      rm -rf "$DIR"; mkdir -p "$DIR"
      out=$("$LOAD" "$DIR" "$SECS" "$POOL" "$fill" "$traffic" "$moves" 2>/dev/null)
      wa=$(sed -n 's/.*write amplification \([0-9.]*\)$/\1/p' <<<"$out")
      steady=$(sed -n 's/.*steady state (last half) \([0-9.]*\)$/\1/p' <<<"$out")
      sim=$(sed -n 's/^simulation, same geometry and traffic: //p' <<<"$out")
      printf '%-8s %-5s %-6s %7s %9s   %s\n' "$traffic" "$fill%" "$moves" "$wa" "$steady" "$sim"
    done
  done
done
