#!/usr/bin/env bash
# The README's commands, run as written:
#  - the quickstart (`scripts/run.sh`) in a fresh data directory, then every line it prints for
#    "another shell", then a stop (SIGTERM: what Ctrl-C does in a terminal; a background job
#    here has SIGINT ignored), then the quickstart again, which must reopen the same pool, volume,
#    export and data;
#  - every `ferrite ...` subcommand the "Using the daemon" block names answers `--help`.
# Called by scripts/test.sh (after the build, so run.sh's own build finds everything fresh).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CARGO_TARGET_DIR:?run through scripts/test.sh, or export CARGO_TARGET_DIR}"
FERRITE="$CARGO_TARGET_DIR/debug/ferrite"

data=$(mktemp -d)
out=$(mktemp)
pid=
cleanup() {
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$data" "$out"
}
trap cleanup EXIT
fail() {
  echo "README: $*" >&2
  sed 's/^/  run.sh| /' "$out" >&2
  exit 1
}

# Starts the quickstart and waits (up to 10 min: it may build) for its "Press Ctrl-C" line.
quickstart() {
  : >"$out"
  FERRITE_DATA_DIR="$data" bash scripts/run.sh >"$out" 2>&1 </dev/null &
  pid=$!
  for _ in $(seq 1 6000); do
    grep -q '^Press Ctrl-C' "$out" && return 0
    kill -0 "$pid" 2>/dev/null || fail "scripts/run.sh exited before serving"
    sleep 0.1
  done
  fail "scripts/run.sh did not come up in 10 minutes"
}

stop() {
  kill -TERM "$pid"
  local rc=0
  wait "$pid" || rc=$?
  pid=
  [ "$rc" = 0 ] || fail "scripts/run.sh exited with $rc after SIGTERM"
}

# The lines printed for "another shell", each run as written.
printed_lines() { sed -n '/^Ferrite is serving/,/^Press Ctrl-C/p' "$out" | sed '1d;$d' | sed 's/^  //'; }

quickstart
n=0
while IFS= read -r line; do
  n=$((n + 1))
  got=$(bash -c "$line" 2>&1) || fail "printed line failed: $line"$'\n'"$got"
  case "$line" in
    nbdinfo*) grep -q 'export-size: 1073741824' <<<"$got" || fail "nbdinfo does not show the 1 GiB volume: $got" ;;
    qemu-io*) grep -q 'read 1048576/1048576' <<<"$got" || fail "qemu-io did not read back its pattern: $got" ;;
    *volume\ list*) grep -qw demo <<<"$got" || fail "volume list does not show demo: $got" ;;
  esac
done < <(printed_lines)
[ "$n" -ge 4 ] || fail "expected the nbdinfo, qemu-img, qemu-io and volume list lines, got $n"
stop

# Again: the same pool, volume, export and data.
quickstart
grep -qw demo "$out" || fail "the second start does not list the demo export"
sock="$data/nbd.sock"
got=$(qemu-io -f raw -c 'read -P 0xab 0 1M' "nbd:unix:$sock:exportname=demo" 2>&1) ||
  fail "reading after a restart: $got"
grep -q 'read 1048576/1048576' <<<"$got" || fail "the data written before the restart is gone: $got"
stop

# Every subcommand the "Using the daemon" block names exists and answers --help.
subs=$(sed -n '/^## Using the daemon/,/^```$/p' README.md | sed -n 's/^\(sudo \)\{0,1\}ferrite \([a-z]*\).*/\2/p' | sort -u)
[ -n "$subs" ] || fail "no ferrite commands found in the README's 'Using the daemon' block"
for s in $subs; do
  "$FERRITE" "$s" --help >/dev/null || fail "'ferrite $s --help' failed (named in the README)"
done
echo "README: quickstart ran as written (twice), its $n printed lines worked; subcommands: $(echo $subs)"
