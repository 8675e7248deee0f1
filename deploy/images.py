#!/usr/bin/env python3
"""Ferrite's OCI images, written as OCI image layouts without a container runtime or network.

    python3 deploy/images.py [--binary target/release/ferrite] [--out target/images] [--tag 0.3.0]

writes two image layouts (https://github.com/opencontainers/image-spec, layout.md):

  OUT/ferrite             the daemon and the CSI node plugin: the binary, the C and C++ runtime
                          it links (glibc, libstdc++ for RocksDB), CA certificates, and the host
                          tools staging runs (mkfs.ext4, mkfs.xfs, mount, umount, blkid,
                          blockdev, fstrim, resize2fs, xfs_growfs) with the libraries they link.
                          Runs as root: it opens block devices and mounts.
  OUT/ferrite-controller  the same binary without the tools; runs as uid 65532 (nonroot).

Every file comes from this Debian machine's installed packages (the image's
`dev.ferrite.packages` annotation lists them with their versions), found by following each
program's ELF interpreter and libraries (ldd). One layer per image, written reproducibly: entries
sorted, owned by root, stamped with SOURCE_DATE_EPOCH (default: the last commit's time), gzip
without a name or time. The same inputs give the same digests; each image's manifest digest is
printed, one `name digest` line per image, and kept in OUT/NAME/digest.
"""

import argparse
import datetime
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

TOOLS = ["mkfs.ext4", "mkfs.xfs", "mount", "umount", "blkid", "blockdev", "fstrim", "resize2fs", "xfs_growfs"]
# Read by the programs at run time: CA certificates (TLS to object stores), mke2fs's defaults.
NODE_FILES = ["/etc/ssl/certs/ca-certificates.crt", "/etc/mke2fs.conf"]
CONTROLLER_FILES = ["/etc/ssl/certs/ca-certificates.crt"]
NONROOT = 65532
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def libraries(program):
    """The program itself and every file its dynamic loader maps (ldd's paths)."""
    out = subprocess.run(["ldd", program], capture_output=True, text=True, check=False).stdout
    paths = [program]
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts:
            at = parts[parts.index("=>") + 1]
            if at.startswith("/"):
                paths.append(at)
        elif parts and parts[0].startswith("/"):
            paths.append(parts[0])  # the interpreter
    return paths


def which(tool):
    for d in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]:
        p = os.path.join(d, tool)
        if os.access(p, os.X_OK):
            return p
    sys.exit(f"images: {tool} is not installed (scripts/setup.sh installs e2fsprogs and xfsprogs)")


class Tree:
    """A root file system to be: path (no leading /) -> (kind, data, mode)."""

    def __init__(self):
        self.entries = {}

    def dir(self, path, mode=0o755):
        path = path.strip("/")
        if path and path not in self.entries:
            self.dir(os.path.dirname(path))
            self.entries[path] = ("dir", None, mode)

    def data(self, path, data, mode=0o644):
        path = path.strip("/")
        self.dir(os.path.dirname(path))
        self.entries[path] = ("file", data, mode)

    def host(self, path):
        """Copies host `path` in: each symbolic link on the way is kept as a link and followed."""
        done = ""
        parts = [p for p in path.split("/") if p]
        while parts:
            part = parts.pop(0)
            here = f"{done}/{part}"
            if os.path.islink(here):
                target = os.readlink(here)
                self.dir(os.path.dirname(here))
                self.entries[here.strip("/")] = ("link", target, 0o777)
                base = target if target.startswith("/") else os.path.join(os.path.dirname(here), target)
                parts = [p for p in os.path.normpath(base).split("/") if p] + parts
                done = ""
            elif parts:
                self.dir(here)
                done = here
            else:
                with open(here, "rb") as f:
                    self.data(here, f.read(), os.stat(here).st_mode & 0o755)

    def tar(self, epoch):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            for path in sorted(self.entries):
                kind, data, mode = self.entries[path]
                info = tarfile.TarInfo(path)
                info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = epoch, mode, 0, 0, "", ""
                if kind == "dir":
                    info.type = tarfile.DIRTYPE
                    t.addfile(info)
                elif kind == "link":
                    info.type, info.linkname = tarfile.SYMTYPE, data
                    t.addfile(info)
                else:
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def packages(paths):
    """`package=version` of the Debian packages owning `paths` (dpkg -S; a merged-/usr path is
    also looked up as the package lists it, without /usr)."""
    names = {"ca-certificates"}  # ca-certificates.crt is made by its update-ca-certificates
    for p in paths:
        real = os.path.realpath(p)
        aliases = [p, real] + [x[4:] for x in (p, real) if x.startswith(("/usr/bin/", "/usr/sbin/", "/usr/lib"))]
        for candidate in dict.fromkeys(aliases):
            r = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True, check=False)
            if r.returncode == 0:
                names.update(n.split(":")[0].strip() for n in r.stdout.split(": ")[0].split(","))
                break
    out = []
    for n in sorted(names):
        v = subprocess.run(["dpkg-query", "-W", "-f=${Version}", n], capture_output=True, text=True, check=False)
        out.append(f"{n}={v.stdout.strip()}")
    return out


def blob(layout, data):
    digest = hashlib.sha256(data).hexdigest()
    path = os.path.join(layout, "blobs", "sha256", digest)
    with open(path, "wb") as f:
        f.write(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def canonical(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def write(layout, name, tree, cmd_user, tag, epoch, sources, version, entrypoint=("/usr/bin/ferrite",)):
    os.makedirs(os.path.join(layout, "blobs", "sha256"), exist_ok=True)
    for old in os.listdir(os.path.join(layout, "blobs", "sha256")):
        os.remove(os.path.join(layout, "blobs", "sha256", old))
    raw = tree.tar(epoch)
    zipped = io.BytesIO()
    with gzip.GzipFile(fileobj=zipped, mode="wb", mtime=0, compresslevel=6, filename="") as z:
        z.write(raw)
    layer = blob(layout, zipped.getvalue())
    layer["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip"
    created = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc)
    labels = {
        "org.opencontainers.image.title": name,
        "org.opencontainers.image.version": version,
        "dev.ferrite.packages": " ".join(sources),
    }
    config = {
        "architecture": ARCH.get(os.uname().machine, os.uname().machine),
        "os": "linux",
        "created": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": {
            "User": cmd_user,
            "Entrypoint": list(entrypoint),
            "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": "/",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(raw).hexdigest()]},
        "history": [{"created": created.strftime("%Y-%m-%dT%H:%M:%SZ"), "created_by": "deploy/images.py"}],
    }
    cfg = blob(layout, canonical(config))
    cfg["mediaType"] = "application/vnd.oci.image.config.v1+json"
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": cfg,
        "layers": [layer],
        "annotations": labels,
    }
    m = blob(layout, canonical(manifest))
    m["mediaType"] = "application/vnd.oci.image.manifest.v1+json"
    m["annotations"] = {"org.opencontainers.image.ref.name": tag}
    with open(os.path.join(layout, "oci-layout"), "wb") as f:
        f.write(canonical({"imageLayoutVersion": "1.0.0"}))
    with open(os.path.join(layout, "index.json"), "wb") as f:
        f.write(canonical({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [m]}))
    with open(os.path.join(layout, "digest"), "w") as f:
        f.write(m["digest"] + "\n")
    return m["digest"]


def base(tree, nonroot_home):
    for d in ["tmp", "var/tmp"]:
        tree.dir(d, 0o1777)
    tree.dir("proc")
    tree.dir("sys")
    tree.dir("dev")
    tree.dir("run", 0o755)
    tree.dir(nonroot_home.strip("/"), 0o700)
    tree.data("etc/passwd", f"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{NONROOT}:{NONROOT}:nonroot:{nonroot_home}:/sbin/nologin\n".encode())
    tree.data("etc/group", f"root:x:0:\nnonroot:x:{NONROOT}:\n".encode())
    tree.data("etc/nsswitch.conf", b"passwd: files\ngroup: files\nhosts: files dns\n")
    # What mount, mke2fs and resize2fs read for the mounted file systems.
    tree.entries["etc/mtab"] = ("link", "../proc/self/mounts", 0o777)
    tree.dir("root", 0o700)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="target/release/ferrite")
    ap.add_argument("--out", default="target/images")
    ap.add_argument("--tag", default=None, help="the image tag (default: the binary's version)")
    a = ap.parse_args()
    if not os.access(a.binary, os.X_OK):
        sys.exit(f"images: {a.binary} is not an executable (cargo build --release --locked --bin ferrite)")
    version = subprocess.run([a.binary, "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    tag = a.tag or version
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        here = os.path.dirname(os.path.abspath(__file__))
        r = subprocess.run(["git", "-C", here, "log", "-1", "--format=%ct"], capture_output=True, text=True, check=False)
        epoch = r.stdout.strip() or "0"
    epoch = int(epoch)
    binary = open(a.binary, "rb").read()

    images = {}
    for name, tools, files, user in [
        ("ferrite", TOOLS, NODE_FILES, "0:0"),
        ("ferrite-controller", [], CONTROLLER_FILES, f"{NONROOT}:{NONROOT}"),
    ]:
        tree = Tree()
        base(tree, "/home/nonroot")
        tree.data("usr/bin/ferrite", binary, 0o755)
        needed = [p for p in libraries(os.path.abspath(a.binary)) if p != os.path.abspath(a.binary)]
        for tool in tools:
            needed += libraries(which(tool))
        needed += files
        for p in sorted(set(needed)):
            tree.host(p)
        for d in ["bin", "sbin", "lib", "lib64"]:
            if os.path.islink(f"/{d}") and d not in tree.entries:
                tree.entries[d] = ("link", os.readlink(f"/{d}"), 0o777)
        digest = write(os.path.join(a.out, name), name, tree, user, tag, epoch, packages(needed), version)
        images[name] = digest
        print(f"{name} {digest}")


if __name__ == "__main__":
    main()
