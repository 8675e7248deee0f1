#!/usr/bin/python3
"""Issue 51's table, rerun: writes with no flush after them, kill -9 of the daemon a moment after
the last acknowledgement, restart, count the acknowledged blocks that did not come back.

    /usr/bin/python3 bench/kill9_table.py [FERRITE_BINARY]   (Debian's python3-libnbd)

One daemon with a default configuration (32 MiB segments) on a scratch data directory, one
client over the NBD Unix socket (libnbd), plain and encrypted volumes, one pool for every row
(so later rows run in a pool after earlier kills). Not part of the suite: it writes ~8 GiB.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import nbd

BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/ferrite/target/debug/ferrite")
B = 4096


def block(row, i):
    return ((row << 40) | i).to_bytes(8, "little") * (B // 8)


class Daemon:
    def __init__(self, data):
        self.data = data
        self.proc = None

    def start(self):
        log = open(os.path.join(self.data, "daemon.log"), "a")
        self.proc = subprocess.Popen([BIN, "daemon", "--data-dir", self.data], stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL)
        for _ in range(600):
            if self.cli("pool", "status", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("daemon did not start")

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def cli(self, *args, check=True):
        return subprocess.run([BIN, "--admin-socket", os.path.join(self.data, "admin.sock"), *args],
                              capture_output=True, check=check)

    def connect(self, name):
        h = nbd.NBD()
        h.connect_uri(f"nbd+unix:///{name}?socket={os.path.join(self.data, 'nbd.sock')}")
        return h

    def last_open(self):
        lines = [l for l in open(os.path.join(self.data, "daemon.log")) if "pool opened" in l]
        return lines[-1].strip() if lines else ""


def row(d, n, name, count, size, wait):
    """`count` writes of `size` bytes, sequential from 0, then kill -9 `wait` s after the last ack."""
    h = d.connect(name)
    per = size // B
    for k in range(count):
        h.pwrite(b"".join(block(n, k * per + j) for j in range(per)), k * size)
    time.sleep(wait)
    d.kill9()
    d.start()
    h = d.connect(name)
    lost = zeros = 0
    total = count * per
    chunk = 256
    for first in range(0, total, chunk):
        m = min(chunk, total - first)
        got = h.pread(m * B, first * B)
        for j in range(m):
            b = got[j * B:(j + 1) * B]
            if b != block(n, first + j):
                lost += 1
                zeros += b == bytes(B)
    h.shutdown()
    return total, lost, zeros


def fio_row(d, name, wait):
    """fio's nbd engine: 2 GiB in 1 MiB writes with crc32c verify headers, no flush, kill -9
    `wait` s after it finished, restart, fio --verify_only over the same range."""
    sock = os.path.join(d.data, "nbd.sock")
    fio = ["fio", "--name=w", "--ioengine=nbd", f"--uri=nbd+unix:///{name}?socket={sock}", "--rw=write",
           "--bs=1M", "--size=2G", "--verify=crc32c", "--verify_state_save=0", "--eta=never"]
    subprocess.run(fio + ["--do_verify=0", "--output=/dev/null"], check=True)
    time.sleep(wait)
    d.kill9()
    d.start()
    r = subprocess.run(fio + ["--verify_only", "--verify_fatal=1"], capture_output=True, text=True)
    return r.returncode == 0, (r.stdout + r.stderr).strip().splitlines()[-1:] if r.returncode else []


def main():
    data = tempfile.mkdtemp(prefix="ferrite-kill9-")
    d = Daemon(data)
    d.start()
    for name, enc in (("plain", []), ("enc", ["--encrypt"])):
        d.cli("volume", "create", name, "3GiB", *enc)
        d.cli("export", "nbd", name)
    rows = [
        ("8192 x 4 KiB", 8192, B, 0.1), ("8192 x 4 KiB", 8192, B, 1.0),
        ("1 GiB in 1 MiB", 1024, 1 << 20, 0.2), ("1 GiB in 1 MiB", 1024, 1 << 20, 2.0),
        ("2 GiB in 1 MiB", 2048, 1 << 20, 3.0),
        ("2048 x 4 KiB", 2048, B, 0.1), ("4096 x 4 KiB", 4096, B, 0.2),
        ("7936 x 4 KiB", 7936, B, 0.3), ("10240 x 4 KiB", 10240, B, 0.3),
        ("512 x 1 MiB", 512, 1 << 20, 0.5),
    ]
    print(f"| writes | volume | kill -9 after | acknowledged blocks | lost | recovery |")
    print(f"|---|---|---|---|---|---|")
    n = 0
    failed = 0
    for label, count, size, wait in rows:
        for name in ("plain", "enc"):
            n += 1
            total, lost, zeros = row(d, n, name, count, size, wait)
            opened = d.last_open()
            fields = {k: v for k, v in (p.split("=", 1) for p in opened.split() if "=" in p)}
            rec = f"replayed={fields.get('replayed_batches')} from_tail={fields.get('from_tail')}"
            print(f"| {label} | {name} | {wait} s | {total} | {lost} ({zeros} zeros) | {rec} |", flush=True)
            failed += lost > 0
    for name in ("plain", "enc"):
        ok, why = fio_row(d, name, 3.0)
        print(f"| 2 GiB in 1 MiB (fio, crc32c verify) | {name} | 3.0 s | 524288 | {'0' if ok else why} | |", flush=True)
        failed += not ok
    d.kill9()
    shutil.rmtree(data)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
