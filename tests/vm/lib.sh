# Sourced by the guest test scripts: the daemon, CLI helpers, fio verification and the
# filesystem lifecycle both transports share. Callers set D (a scratch dir) and DEV_PREFIX (the
# device path `ferrite attach` must produce, e.g. /dev/ublkb).
FERRITE=${FERRITE:-$(cat .vm-ferrite 2>/dev/null || echo /root/.cache/ferrite/target/debug/ferrite)}
export FERRITE_ADMIN_SOCKET=$D/admin.sock
f() { timeout 120 "$FERRITE" "$@"; }
step() { echo "== $* (at $SECONDS s)"; }
live() { f -o json pool status | sed -n 's/.*"live":\([0-9]*\).*/\1/p'; }
sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }

# start_daemon CONFIG-LINES: (re)starts the daemon ($DAEMON_BIN, default $FERRITE) on $D,
# appending to its log; sets DAEMON.
start_daemon() {
  [ -f $D/ferrite.toml ] || printf '%b' "$1" > $D/ferrite.toml
  "${DAEMON_BIN:-$FERRITE}" daemon --config $D/ferrite.toml --data-dir $D >> $D/daemon.log 2>&1 &
  DAEMON=$!
  for _ in $(seq 300); do "$FERRITE" pool status >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "daemon did not start"; cat $D/daemon.log; exit 1
}

# attach VOLUME [ARGS]: sets DEV to the device `ferrite attach` made (its stderr goes to ours).
attach() {
  DEV=$(f attach "$@"); test -b "$DEV"
  case $DEV in "$DEV_PREFIX"*) ;; *) echo "expected a $DEV_PREFIX device, got $DEV"; exit 1;; esac
}
detach() { f detach "$1" >/dev/null; }

# fio_verify DEVICE: crc32c-verified random 4k and sequential 128k writes.
fio_verify() {
  local v="--ioengine=libaio --direct=1 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --eta=never --output=/dev/null"
  timeout 300 fio --name=v --filename="$1" --rw=randwrite --bs=4k --iodepth=16 --size=32M $v
  timeout 300 fio --name=s --filename="$1" --rw=write --bs=128k --iodepth=4 --offset=64M --size=32M $v
}

write_tree() {
  for i in $(seq 40); do
    mkdir -p "$1/d$((i % 5))"
    head -c $((i * 37 * 1024)) /dev/urandom > "$1/d$((i % 5))/f$i"
  done
  head -c 24M /dev/urandom > "$1/big"
}

# fs_lifecycle FS (ext4|xfs): mkfs, files, detach, re-attach, compare; delete, fstrim, reclaim.
fs_lifecycle() {
  local fs=$1
  step "$fs: mkfs, files, detach, re-attach, compare"
  f volume create "$fs" 512M >/dev/null
  attach "$fs" 2>/dev/null
  if [ "$fs" = ext4 ]; then mkfs.ext4 -q -F "$DEV"; else mkfs.xfs -q -f "$DEV"; fi
  mkdir -p /mnt/$fs; mount "$DEV" /mnt/$fs
  write_tree /mnt/$fs
  sums /mnt/$fs > /tmp/$fs.sums
  sync; umount /mnt/$fs; detach "$DEV"
  attach "$fs" 2>/dev/null; mount "$DEV" /mnt/$fs
  (cd /mnt/$fs && sha256sum --quiet -c /tmp/$fs.sums)
  step "$fs: delete files, fstrim, reclaim"
  local before after
  before=$(live)
  rm -rf /mnt/$fs/big /mnt/$fs/d1 /mnt/$fs/d2; sync
  fstrim -v /mnt/$fs
  f pool reclaim >/dev/null
  after=$(live)
  echo "live bytes: $before -> $after"
  [ "$after" -lt $((before - 20 * 1024 * 1024)) ] || { echo "fstrim gave back too little"; exit 1; }
  umount /mnt/$fs; detach "$DEV"
}

# snapshot_mount: snapshots the ext4 volume as s1, attaches it and mounts it read-only at /mnt/snap.
snapshot_mount() {
  f snapshot create ext4 s1 >/dev/null
  attach ext4@s1 2>/dev/null
  [ "$(blockdev --getro "$DEV")" = 1 ] || { echo "snapshot device is writable"; exit 1; }
  mkdir -p /mnt/snap; mount -o ro,noload "$DEV" /mnt/snap
  test -f /mnt/snap/d0/f5
}

stop_daemon() {
  kill -TERM $DAEMON
  wait $DAEMON || { echo "daemon exited with $?"; cat $D/daemon.log; exit 1; }
}

# encrypted_lifecycle: an encrypted volume as a block device: fio verify, ext4 files, its data
# key replaced while mounted and in use, detach, re-attach, compare; none of the files'
# plaintext in the pool file.
encrypted_lifecycle() {
  step "encrypted: fio verify, ext4, a data-key rotation while mounted, re-attach, compare"
  f volume create enc 512M --encrypt >/dev/null
  attach enc 2>/dev/null
  fio_verify "$DEV"
  mkfs.ext4 -q -F "$DEV"; mkdir -p /mnt/enc; mount "$DEV" /mnt/enc
  write_tree /mnt/enc
  printf 'FERRITE-SECRET-MARKER-%08d\n' $(seq 100000) > /mnt/enc/marker
  sync
  head -c 8M /dev/urandom > /mnt/enc/during &
  local writer=$!
  f volume rekey enc --data-key 2>&1 | grep encryption
  wait "$writer"  # not a bare wait: the daemon runs in the background too
  sums /mnt/enc > /tmp/enc.sums
  sync; umount /mnt/enc; detach "$DEV"
  attach enc 2>/dev/null; mount "$DEV" /mnt/enc
  (cd /mnt/enc && sha256sum --quiet -c /tmp/enc.sums)
  umount /mnt/enc; detach "$DEV"
  # In chunks (grep would hold a whole NUL-free "line" of the pool file in memory).
  python3 -c 'import sys
f = open(sys.argv[1], "rb"); prev = b""
while chunk := f.read(1 << 20):
    if b"FERRITE-SECRET-MARKER" in prev[-32:] + chunk: sys.exit("plaintext of an encrypted volume in the pool file")
    prev = chunk' $D/pool.img
  f volume delete enc >/dev/null
}

# restarts_under_io DEVICE RESTART [HOW...]: ext4 on DEVICE, fio writing files and verifying them
# as it goes, while RESTART (a function given TERM or KILL) replaces the daemon behind the device
# three times (SIGTERM, kill -9, SIGTERM, each followed by a start of another binary; or once per
# HOW given): no I/O error, no verify failure, fsck clean; prints the longest I/O, which is the
# pause a restart cost.
restarts_under_io() {
  local dev=$1 restart=$2; shift 2
  local hows=${*:-TERM KILL TERM}
  next_binary >/dev/null  # copied now: the copy is not part of a pause
  mkfs.ext4 -q -F "$dev"; mkdir -p /mnt/io; mount "$dev" /mnt/io
  timeout 900 fio --name=io --directory=/mnt/io --size=24M --nrfiles=3 --rw=randwrite --bs=4k --ioengine=libaio \
    --direct=1 --iodepth=8 --verify=crc32c --verify_backlog=128 --verify_fatal=1 --verify_state_save=0 \
    --runtime=50 --time_based --eta=never --output-format=json --output=$D/io.json &
  local fio=$! how
  for how in $hows; do
    sleep 6
    echo "daemon replaced ($how)"
    "$restart" $how
  done
  wait $fio || { cat $D/io.json; echo "fio saw an error across daemon restarts"; exit 1; }
  python3 - $D/io.json <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
assert job["error"] == 0, job["error"]
longest = max(job["write"]["clat_ns"]["max"], job["read"]["clat_ns"]["max"]) / 1e6
print(f"no I/O error, no verify failure; {job['write']['total_ios']} writes, "
      f"{job['read']['total_ios']} verify reads; longest I/O (the pause): {longest:.0f} ms")
PY
  umount /mnt/io
  fsck.ext4 -n -f "$dev" >/dev/null
}

# next_binary: a copy of the daemon's binary, to replace it with (in the read-write host
# directory: the guest's tmpfs holds the pools).
next_binary() {
  [ -x "$PWD/.vm-ferrite-next" ] || cp -f "$FERRITE" "$PWD/.vm-ferrite-next"
  echo "$PWD/.vm-ferrite-next"
}

# restart_local TERM|KILL: the daemon on $D stops that way; a copy of its binary starts.
restart_local() {
  kill -"$1" $DAEMON; wait $DAEMON 2>/dev/null || true
  DAEMON_BIN=$(next_binary) start_daemon
}
