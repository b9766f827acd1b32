# Sourced by build-deb.sh for KTD_DEB_ARCH=arm64 (`make deb ARCH=arm64`): the aarch64 wheelhouse and
# dpkg-buildpackage in the arm64 Debian 12 root (tools/arm64/make-root.sh, KTD_ARM64_ROOT) under
# qemu-user-static, so that the package is built by Debian's arm64 python3.11 and debhelper as on
# an arm64 machine (dh_shlibdeps reads the arm64 libraries and dpkg database); only the native
# module is cross-compiled on the host (tools/arm64/cross-build.sh, the build `make test-arm64`
# tests).
ARM64_ROOT=${KTD_ARM64_ROOT:-$HOME/.cache/ktd/arm64-root}
export KTD_ARM64_ROOT=$ARM64_ROOT
# $OUT's mount point in the root, one per checkout (the root is shared with other worktrees' runs).
BMNT=/ktdbuild-$(basename "$ROOT" | tr -c 'A-Za-z0-9_.\n-' _)

# pip download for Debian 12 arm64: CPython 3.11, glibc 2.36 (every manylinux level up to it; e.g.
# llguidance's aarch64 wheel is manylinux_2_31).
arm64_pip_platforms() {
  local v
  for v in $(seq 36 -1 17); do printf -- '--platform\nmanylinux_2_%s_aarch64\n' "$v"; done
  printf -- '--platform\nmanylinux2014_aarch64\n--platform\nlinux_aarch64\n'
}

# 2. the wheelhouse: PyPI's aarch64 (or pure) wheels at the pins of requirements-runtime.txt,
# systemd-python cross-compiled from its sdist against the arm64 root (arm64_systemd_python), ktd's
# wheel around the cross-built module (tools/arm64/make-wheel.py).
arm64_wheelhouse() {
  KTD_PYTHON="$BUILD_VENV/bin/python" "$ROOT/tools/arm64/make-root.sh" >"$OUT/make-root.log" 2>&1 \
    || { tail -30 "$OUT/make-root.log" >&2; die "the arm64 root could not be made (log: $OUT/make-root.log)"; }
  mkdir -p "$WHEELHOUSE"
  say "wheelhouse (aarch64): pinned PyPI wheels"
  grep -v '^systemd-python==' "$REQS" >"$OUT/requirements-binary.txt"
  local platforms
  mapfile -t platforms < <(arm64_pip_platforms)
  "${PIP[@]}" download -q --only-binary=:all: --no-deps --python-version 3.11 --implementation cp \
    --abi cp311 --abi abi3 --abi none "${platforms[@]}" -d "$WHEELHOUSE" -r "$OUT/requirements-binary.txt"
  if bad=$(ls "$WHEELHOUSE"/*.whl | grep -vE '(_aarch64|-none-any)\.whl$'); then
    die "wheels for another platform in $WHEELHOUSE: $bad"
  fi
  sd_pin=$(grep '^systemd-python==' "$REQS")
  if ! ls "$WHEELHOUSE"/systemd_python-"${sd_pin#*==}"-*_aarch64.whl >/dev/null 2>&1; then
    say "wheelhouse (aarch64): $sd_pin from its sdist, cross-compiled against the arm64 root"
    arm64_systemd_python "$sd_pin"
  fi
  say "wheelhouse (aarch64): ktd $WHEEL_VERSION (cross-built native core, Release)"
  rm -f "$WHEELHOUSE"/ktd-*.whl
  # The host Python, cmake and ninja of `make test-arm64` (the development venv) when there is
  # one, so that both use the same build/arm64 without recompiling (pybind11's path is part of
  # the compile flags); the build venv (the same pins) otherwise.
  local so hostpy=${KTD_HOST_PYTHON:-$ROOT/.venv/bin/python}
  [ -x "$hostpy" ] || hostpy=$BUILD_VENV/bin/python
  # KTD_ARM64_SO: an aarch64 module already built (e.g. on an ARM machine) instead of the cross build.
  if [ -n "${KTD_ARM64_SO:-}" ]; then so=$KTD_ARM64_SO; else
  so=$(KTD_HOST_PYTHON="$hostpy" CMAKE="${CMAKE:-$(dirname "$hostpy")/cmake}" NINJA="${NINJA:-$(dirname "$hostpy")/ninja}" \
       "$ROOT/tools/arm64/cross-build.sh" 2>"$OUT/cross-build.log" | tail -1) \
    || { tail -30 "$OUT/cross-build.log" >&2; die "the aarch64 cross build failed (log: $OUT/cross-build.log)"; }
  fi
  "$BUILD_VENV/bin/python" "$ROOT/tools/arm64/make-wheel.py" "$ROOT" "$so" "$WHEELHOUSE" >/dev/null
}

# systemd-python's aarch64 wheel, cross-compiled on the host: the build venv's setuptools runs its
# setup.py with the arm64 root's sysconfig data (_PYTHON_SYSCONFIGDATA_NAME: the compiler it names is
# Debian's aarch64-linux-gnu-gcc, the extension suffix and the wheel tag are aarch64's) and the root
# as the compiler's sysroot (its python3.11 headers, libc and libsystemd-dev; pkg-config reads the
# root's libsystemd.pc). The same wheel as a build in the root (cp311-cp311-linux_aarch64) without
# emulated gcc, which took minutes. The wheel is then imported by the root's python3 under qemu.
# No build isolation: pip's isolated environment replaces PYTHONPATH, which carries the sysconfig
# data; bdist_wheel comes from the `wheel` pin of requirements-dev.txt.
arm64_systemd_python() {
  local sd_pin=$1 sysconfig=$OUT/cross-sysconfig name=_sysconfigdata__linux_aarch64-linux-gnu
  rm -rf "$OUT/sdist" "$sysconfig" "$OUT/sdcheck" && mkdir -p "$OUT/sdist" "$sysconfig"
  "${PIP[@]}" install -q "$(grep '^wheel==' "$ROOT/requirements-dev.txt")"
  "${PIP[@]}" download -q --no-binary :all: --no-deps -d "$OUT/sdist" "$sd_pin"
  cp "$ARM64_ROOT/usr/lib/python3.11/$name.py" "$sysconfig/"
  # -I: the root's Python.h before the host's (setuptools adds the host's /usr/include/python3.11).
  env _PYTHON_HOST_PLATFORM=linux-aarch64 _PYTHON_SYSCONFIGDATA_NAME=$name PYTHONPATH="$sysconfig" \
    CFLAGS="--sysroot=$ARM64_ROOT -I$ARM64_ROOT/usr/include/python3.11" LDFLAGS="--sysroot=$ARM64_ROOT" \
    PKG_CONFIG_LIBDIR="$ARM64_ROOT/usr/lib/aarch64-linux-gnu/pkgconfig:$ARM64_ROOT/usr/share/pkgconfig" \
    PKG_CONFIG_SYSROOT_DIR="$ARM64_ROOT" \
    "${PIP[@]}" wheel -v --no-cache-dir --no-deps --no-build-isolation -w "$OUT/sdist/wheel" "$OUT"/sdist/*.tar.gz \
    >"$OUT/systemd-python.log" 2>&1 \
    || { tail -30 "$OUT/systemd-python.log" >&2; die "systemd-python's cross build failed (log: $OUT/systemd-python.log)"; }
  local whl
  whl=$(ls "$OUT"/sdist/wheel/systemd_python-"${sd_pin#*==}"-cp311-cp311-linux_aarch64.whl) \
    || die "systemd-python's cross build made no cp311 linux_aarch64 wheel: $(ls "$OUT/sdist/wheel")"
  "$BUILD_VENV/bin/python" -m zipfile -e "$whl" "$OUT/sdcheck"
  arm64_in_root env PYTHONPATH=$BMNT/sdcheck PYTHONDONTWRITEBYTECODE=1 python3 -c '
from systemd import journal, daemon, id128, login
import systemd._reader
assert daemon.booted() in (True, False)
assert daemon.notify("READY=1") is False  # no NOTIFY_SOCKET here
assert len(id128.get_boot().hex) == 32
print("systemd-python (aarch64, cross-built) imports and runs under qemu:", journal.__file__)
' || die "the cross-built systemd-python does not work in the arm64 root"
  mv "$whl" "$WHEELHOUSE/"
}

# Run a command in the arm64 root with $OUT at /ktdbuild, /proc, /sys and /dev mounted (compileall
# and pip use multiprocessing); the mounts go when it returns.
arm64_in_root() {
  mkdir -p "$ARM64_ROOT$BMNT"
  debroot_mount "$ARM64_ROOT"
  mount --bind "$OUT" "$ARM64_ROOT$BMNT"
  local rc=0
  chroot "$ARM64_ROOT" /usr/bin/env -i HOME=/tmp PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$@" || rc=$?
  umount "$ARM64_ROOT$BMNT" || umount -l "$ARM64_ROOT$BMNT"
  debroot_umount "$ARM64_ROOT"
  return $rc
}

# 3. dpkg-buildpackage in the arm64 root; make-venv.sh installs /opt/ktd with Debian's arm64 pip
# (python3-pip, `pip --python`) from the wheelhouse, offline. -d: the root has the Build-Depends
# (debhelper, python3.11, python3.11-venv; make-root.sh) but not build-essential, which dpkg wants
# implicitly and nothing here uses (no compiler runs in this build).
arm64_dpkg_buildpackage() {
  arm64_in_root sh -c "cd $BMNT/src && KTD_WHEELHOUSE=$BMNT/wheelhouse KTD_REQUIREMENTS=$BMNT/requirements-runtime.txt \
      KTD_WHEEL_VERSION=$WHEEL_VERSION KTD_BUILD_PIP=/usr/bin/pip3 dpkg-buildpackage -b -us -uc -d" >"$OUT/dpkg-buildpackage.log" 2>&1
}

# 4. dh_builddeb wrote the package uncompressed under qemu (debian/rules); compressed here, natively,
# with xz level 1 as before (21 MB; the default level took 54 s of CPU here, level 1 a few; lintian
# accepts only gz/xz members, not zstd or none).
# dpkg-deb -R keeps the control files and every file's owner, mode and mtime (SOURCE_DATE_EPOCH
# clamps them as dh_builddeb's did, from the changelog): the listing and the control fields are
# checked to be unchanged. The .changes and .buildinfo, whose checksums were of the uncompressed
# file, are removed (only the .deb is used).
arm64_compress_deb() {
  local deb=$1 changelog=$2 tree=$OUT/deb-tree
  rm -rf "$tree" "$deb.xz"
  dpkg-deb -R "$deb" "$tree"
  SOURCE_DATE_EPOCH=$(dpkg-parsechangelog -l "$changelog" -S Timestamp) dpkg-deb -Zxz -z1 -b "$tree" "$deb.xz" >/dev/null
  diff <(dpkg-deb -c "$deb") <(dpkg-deb -c "$deb.xz") && diff <(dpkg-deb -f "$deb") <(dpkg-deb -f "$deb.xz") \
    || die "the recompressed $deb differs from dh_builddeb's"
  mv "$deb.xz" "$deb"
  rm -rf "$tree" "$OUT"/ktd_*.changes "$OUT"/ktd_*.buildinfo
}

# 5. the bundle's closure in the arm64 base: the host's apt on the base's apt configuration and
# dpkg database (Dir=the root, APT::Architecture=arm64, as mmdebstrap drives apt for a foreign
# root), so the same resolution as apt-get in the root without emulating apt (110 s at load 8;
# 22 s natively: the same 21 packages). --download-only: nothing is installed.
arm64_bundle_download() {
  local r=$1 deb=$2
  local apt=(apt-get -o Dir="$r" -o Dir::State::status="$r/var/lib/dpkg/status" -o APT::Architecture=arm64
             -o APT::Architectures::=arm64 -o Debug::NoLocking=1)
  "${apt[@]}" update -qq >/dev/null \
    && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -qq -y --download-only --no-install-recommends "$r$deb"
}
