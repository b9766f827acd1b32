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
# systemd-python built from its sdist in the arm64 root (gcc, libsystemd-dev there), ktd's wheel
# around the cross-built module (tools/arm64/make-wheel.py).
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
    say "wheelhouse (aarch64): $sd_pin from its sdist, built in the arm64 root (emulated gcc)"
    rm -rf "$OUT/sdist" && mkdir -p "$OUT/sdist"
    "${PIP[@]}" download -q --no-binary :all: --no-deps -d "$OUT/sdist" "$sd_pin"
    arm64_in_root sh -c "cd $BMNT && pip3 wheel -q --no-cache-dir --no-deps --no-build-isolation --no-index -w $BMNT/wheelhouse $BMNT/sdist/*"
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
