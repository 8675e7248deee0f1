#!/usr/bin/env python3
"""OCI image layouts of static programs, for the one-node cluster's registry.

    python3 tests/kubelet/static_images.py OUT NAME=PROGRAM[:ENTRY][+sh] ...

Each NAME becomes the layout OUT/NAME holding PROGRAM at /ENTRY (default: its file name) as the
image's entrypoint, with deploy/images.py's base tree (/tmp, /etc/passwd, ...) and its writer
(one reproducible layer). The sidecars, pause, agnhost and busybox are static: they need
nothing else. `+sh`: the host's static busybox too, with its applets in /bin (as the e2e
suite's busybox and agnhost images have a shell). Prints `NAME digest` per image.
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../deploy"))
import images  # noqa: E402  (deploy/images.py)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__.strip().split("\n\n")[1])
    out = sys.argv[1]
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "1767225600"))
    for spec in sys.argv[2:]:
        name, program = spec.split("=", 1)
        program, shell = (program[:-3], True) if program.endswith("+sh") else (program, False)
        program, _, entry = program.partition(":")
        entry = "/" + (entry or os.path.basename(program)).lstrip("/")
        tree = images.Tree()
        images.base(tree, "/home/nonroot")
        if shell:
            busybox = "/bin/busybox"
            tree.host(busybox)
            listed = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout
            # Beside it (the host's /bin may be a link to usr/bin, which the tree keeps).
            at = os.path.dirname(os.path.realpath(busybox)).strip("/")
            for applet in listed.split():
                tree.entries.setdefault(f"{at}/{applet}", ("link", "busybox", 0o777))
        with open(program, "rb") as f:
            tree.data(entry, f.read(), 0o755)
        digest = images.write(os.path.join(out, name), name, tree, "0:0", "latest", epoch, [], "test",
                              entrypoint=(entry,))
        print(f"{name} {digest}")


if __name__ == "__main__":
    main()
