# Sourced by build-deb.sh and test-deb.sh: a minimal Debian 12 root (debootstrap
# --variant=minbase bookworm, 88 packages, no python/procps/systemd), cached as a tarball in
# ${KTD_CACHE:-~/.cache/ktd}/debian/ (or KTD_DEBIAN_CACHE: e.g. a throw-away one to measure a
# fresh machine) so that reruns do not bootstrap again (KTD_REFRESH_BASE=1 rebuilds it). The
# tarball is also piuparts' --basetgz.

KTD_CACHE=${KTD_CACHE:-$HOME/.cache/ktd}
DEBIAN_MIRROR=${KTD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY_MIRROR=${KTD_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
DEBIAN_CACHE=${KTD_DEBIAN_CACHE:-$KTD_CACHE/debian}
BASE_TGZ=$DEBIAN_CACHE/bookworm-minbase.tgz
# DEBROOT_ARCH=arm64 (make deb/test-deb ARCH=arm64): an arm64 base instead, whose programs run under
# qemu-user-static through binfmt_misc (tools/arm64/binfmt.sh); with mmdebstrap (debs cached beside
# the tarball) the packages are unpacked by the host and only configured under qemu (see
# debroot_configure_unpacked), else debootstrap's emulated second stage.
DEBROOT_ARCH=${DEBROOT_ARCH:-amd64}
[ "$DEBROOT_ARCH" = amd64 ] || BASE_TGZ=$DEBIAN_CACHE/bookworm-minbase-$DEBROOT_ARCH.tgz

# Create the base tarball if it is missing (network: the Debian mirror).
debroot_base() {
  if [ -s "$BASE_TGZ" ] && [ -z "${KTD_REFRESH_BASE:-}" ]; then
    return 0
  fi
  command -v debootstrap >/dev/null || { echo "debootstrap is not installed" >&2; return 1; }
  mkdir -p "$(dirname "$BASE_TGZ")"
  local dir
  dir=$(mktemp -d "$(dirname "$BASE_TGZ")/bootstrap.XXXXXX")
  if [ "$DEBROOT_ARCH" = amd64 ]; then
  echo "debootstrap --variant=minbase bookworm (cached in $BASE_TGZ afterwards)"
  debootstrap --variant=minbase bookworm "$dir" "$DEBIAN_MIRROR" >"$dir.log" 2>&1 \
    || { tail -20 "$dir.log" >&2; rm -rf "$dir"; return 1; }
  elif command -v mmdebstrap >/dev/null; then
    # minbase's packages (Essential, Priority: required, apt; merged /usr as Debian 12 installs
    # it), unpacked by the host's dpkg-deb (--variant=extract) instead of dpkg under qemu, then
    # configured by their own maintainer scripts under qemu (debroot_configure_unpacked). Their
    # own cache of debs: the extract hook registers every deb of the archives directory.
    echo "mmdebstrap --arch=$DEBROOT_ARCH --variant=extract of minbase's packages, configured under qemu (cached in $BASE_TGZ afterwards)"
    local debs=$DEBIAN_CACHE/$DEBROOT_ARCH-minbase-archives
    mkdir -p "$debs"
    mmdebstrap --mode=root --arch="$DEBROOT_ARCH" --variant=extract \
      --include='?essential' --include='?priority(required)' --include=apt,usr-is-merged \
      --setup-hook=/usr/share/mmdebstrap/hooks/merged-usr/setup00.sh \
      --setup-hook='mkdir -p "$1/var/cache/apt/archives"' --setup-hook="sync-in $debs /var/cache/apt/archives/" \
      --skip=download/empty --extract-hook="sync-out /var/cache/apt/archives $debs" \
      --extract-hook="python3 '$ROOT/tools/arm64/dpkg-register.py' --unpacked \"\$1\" \"\$1\"/var/cache/apt/archives/*.deb" \
      bookworm "$dir" "$DEBIAN_MIRROR" >"$dir.log" 2>&1 \
      && debroot_configure_unpacked "$dir" >>"$dir.log" 2>&1 \
      || { tail -20 "$dir.log" >&2; rm -rf "$dir"; return 1; }
  else
    echo "debootstrap --arch=$DEBROOT_ARCH --variant=minbase bookworm (cached in $BASE_TGZ afterwards)"
    debootstrap --arch="$DEBROOT_ARCH" --variant=minbase bookworm "$dir" "$DEBIAN_MIRROR" >"$dir.log" 2>&1 \
      || { tail -20 "$dir.log" >&2; rm -rf "$dir"; return 1; }
  fi
  # Point releases and security updates are part of what a maintained Debian 12 installs.
  cat >"$dir/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb $DEBIAN_SECURITY_MIRROR bookworm-security main
EOF
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  chmod 0755 "$dir"   # mktemp's 0700 would become the root's / (other users could not run anything)
  tar -C "$dir" -czf "$BASE_TGZ.tmp" . && mv "$BASE_TGZ.tmp" "$BASE_TGZ"
  rm -rf "$dir" "$dir.log"
}

# Configure a root whose packages were unpacked by the host and recorded as unpacked
# (tools/arm64/dpkg-register.py --unpacked): `dpkg --configure -a` runs every package's postinst
# in the root, as a bootstrap's second stage does, base-passwd first (base-files' postinst chowns
# to root:root, which needs /etc/passwd; its libraries are unpacked, which is all it needs of
# them: --force-depends). The preinsts do not run: of minbase's twelve, base-passwd's writes
# /etc/passwd and /etc/group, as its postinst does on a first configure (the result is the same
# as mmdebstrap minbase's), libc6's and usr-is-merged's only check the system, and the others act
# on upgrades only. Fails unless every package ends "install ok installed" and dpkg --audit is
# clean.
debroot_configure_unpacked() {
  local r=$1 rc=0
  mount -t proc proc "$r/proc" && mount --bind /dev "$r/dev" || return 1
  local run=(chroot "$r" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8)
  "${run[@]}" dpkg --configure --force-depends base-passwd && "${run[@]}" dpkg --configure -a || rc=1
  umount "$r/proc" "$r/dev"
  [ $rc = 0 ] || return 1
  if "${run[@]}" dpkg-query -W -f='${Package} ${Status}\n' | grep -v ' install ok installed$'; then
    echo "debroot: packages left unconfigured (above)"; return 1
  fi
  "${run[@]}" dpkg --audit
}

# Unpack the base into a new directory and print its path.
debroot_new() {
  local dir
  dir=$(mktemp -d "${1:-/tmp}/debroot.XXXXXX")
  tar -C "$dir" -xzf "$BASE_TGZ"
  chmod 0755 "$dir"
  cp /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
  echo "$dir"
}

# Mount /proc, /sys (read-only) and /dev into a root (the daemon reads /proc/meminfo and the NUMA
# topology in /sys); debroot_umount undoes it.
debroot_mount() {
  mount -t proc proc "$1/proc"
  mount --rbind /sys "$1/sys" && mount --make-rslave "$1/sys"
  mount --bind /dev "$1/dev"
}

debroot_umount() {
  local m
  for m in dev sys proc; do
    mountpoint -q "$1/$m" && umount -R "$1/$m" 2>/dev/null || umount -l "$1/$m" 2>/dev/null || true
  done
}

# Remove a root created by debroot_new (never while something is mounted in it).
debroot_remove() {
  debroot_umount "$1"
  if grep -q " $1/" /proc/mounts; then
    echo "debroot: $1 still has mounts, not removing it" >&2
    return 1
  fi
  rm -rf "$1"
}
