#!/bin/bash
# Make sure the kernel runs aarch64 ELF binaries through qemu-aarch64-static (binfmt_misc), which
# the arm64 root's programs need: mount binfmt_misc when it is not, enable Debian's qemu-aarch64
# entry (flag F: the interpreter is opened now, so it works inside a chroot).
set -euo pipefail
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    command -v update-binfmts >/dev/null || { echo "binfmt.sh: update-binfmts not found (apt-get install binfmt-support qemu-user-static)" >&2; exit 1; }
    update-binfmts --enable qemu-aarch64
fi
grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 || { echo "binfmt.sh: qemu-aarch64 binfmt entry is disabled" >&2; exit 1; }
