#!/bin/bash
# make deb: dist/ktd_<version>~deb12_amd64.deb and the offline bundle dist/ktd-bundle-<version>/
# (the .deb plus every .deb of its dependency closure that a minimal Debian 12 lacks).
#
# Steps (docs/OPERATIONS.md, "The Debian package"):
#   1. a build venv from Debian's /usr/bin/python3.11 (the interpreter the package runs on);
#   2. the wheelhouse: PyPI wheels pinned in packaging/requirements-runtime.txt, systemd-python
#      built from its sdist against libsystemd-dev, ktd's own wheel (scikit-build-core);
#   3. dpkg-buildpackage in build/deb/src (debian/ from packaging/debian; debian/rules installs
#      /opt/ktd offline from the wheelhouse with make-venv.sh);
#   4. the bundle's closure: `apt-get install --download-only` of the .deb in a minimal
#      Debian 12 root (debroot.sh).
#
# KTD_VERSION overrides the package's upstream version (default: pyproject.toml's), e.g. to build
# a newer package for the upgrade test; KTD_SKIP_BUNDLE=1 builds the .deb only.
# KTD_DEB_ARCH=arm64 (`make deb ARCH=arm64`) builds ktd_<version>~deb12_arm64.deb and its bundle
# instead (packaging/build-deb-arm64.sh: aarch64 wheels, the cross-built native module, and
# dpkg-buildpackage in the arm64 root of tools/arm64 under qemu-user-static).
# Network: PyPI (step 2) and the Debian mirror (step 4, and apt-get for missing build tools).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ARCH=${KTD_DEB_ARCH:-amd64}
case $ARCH in amd64|arm64) ;; *) echo "build-deb: ARCH=$ARCH: only amd64 and arm64" >&2; exit 1 ;; esac
export DEBROOT_ARCH=$ARCH
. packaging/debroot.sh

say() { printf '== %s\n' "$*"; }
die() { printf 'build-deb: %s\n' "$*" >&2; exit 1; }

WHEEL_VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
[ -n "$WHEEL_VERSION" ] || die "no version in pyproject.toml"
UPSTREAM_VERSION=${KTD_VERSION:-$WHEEL_VERSION}
DEB_VERSION=$UPSTREAM_VERSION~deb12
OUT=$ROOT/build/deb
[ "$ARCH" = amd64 ] || OUT=$ROOT/build/deb-$ARCH
DIST=${KTD_DIST:-$ROOT/dist}
DEB=ktd_${DEB_VERSION}_${ARCH}.deb

# --- build tools -----------------------------------------------------------------------------
. /etc/os-release
[ "${VERSION_CODENAME:-}" = bookworm ] || die "this builds the Debian 12 package and must run on Debian 12 (this is ${PRETTY_NAME:-unknown}): the venv links /usr/bin/python3.11 of the build machine"
need=()
pkgs=(debhelper python3.11-venv python3.11-dev libsystemd-dev pkg-config g++ debootstrap)
[ "$ARCH" = amd64 ] || pkgs+=(g++-aarch64-linux-gnu qemu-user-static binfmt-support mmdebstrap arch-test file)
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing build packages: ${need[*]} (apt-get install them, or run as root)"
  say "apt-get install ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
dpkg -S /usr/bin/python3.11 >/dev/null 2>&1 || die "/usr/bin/python3.11 is not Debian's python3.11"

# --- 1. build venv ---------------------------------------------------------------------------
BUILD_VENV=$OUT/buildvenv
if [ ! -x "$BUILD_VENV/bin/pip" ] || [ "$(readlink -f "$BUILD_VENV/bin/python")" != /usr/bin/python3.11 ]; then
  say "build venv ($BUILD_VENV) from /usr/bin/python3.11"
  rm -rf "$BUILD_VENV"
  /usr/bin/python3.11 -m venv "$BUILD_VENV"
fi
# The build tools with the pins of requirements-dev.txt; a current pip (bookworm's 23.0 cannot
# build systemd-python's legacy sdist without the `wheel` package), as `make venv` does.
build_pins=$(grep -E '^(pybind11|scikit-build-core|cmake|ninja)==' requirements-dev.txt)
"$BUILD_VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip
# shellcheck disable=SC2086
"$BUILD_VENV/bin/pip" install -q --disable-pip-version-check $build_pins
PIP=("$BUILD_VENV/bin/pip" --disable-pip-version-check)

# --- 2. wheelhouse ---------------------------------------------------------------------------
WHEELHOUSE=$OUT/wheelhouse
REQS=$ROOT/packaging/requirements-runtime.txt
mkdir -p "$WHEELHOUSE"
if [ "$ARCH" = arm64 ]; then
  . packaging/build-deb-arm64.sh
  arm64_wheelhouse
else
say "wheelhouse: pinned PyPI wheels"
grep -v '^systemd-python==' "$REQS" >"$OUT/requirements-binary.txt"
"${PIP[@]}" download -q --only-binary=:all: --no-deps -d "$WHEELHOUSE" -r "$OUT/requirements-binary.txt"
sd_pin=$(grep '^systemd-python==' "$REQS")
if ! ls "$WHEELHOUSE"/systemd_python-"${sd_pin#*==}"-*.whl >/dev/null 2>&1; then
  say "wheelhouse: $sd_pin from its sdist (against libsystemd-dev)"
  # --no-cache-dir: pip's wheel cache may hold a build by another interpreter (seen: a RUNPATH
  # into a pyenv Python, which lintian rejects).
  "${PIP[@]}" wheel -q --no-cache-dir --no-deps --no-binary systemd-python -w "$WHEELHOUSE" "$sd_pin"
fi
say "wheelhouse: ktd $WHEEL_VERSION (native core, Release; CUDA backend: KTD_CUDA=${KTD_CUDA:-AUTO})"
rm -f "$WHEELHOUSE"/ktd-*.whl
# KTD_CUDA=AUTO (default) builds libktd_cuda.so when nvcc is found (PATH or CMAKE_CUDA_COMPILER),
# ON requires it, OFF leaves it out; the library links cudart statically and needs only the
# NVIDIA driver where it runs (it is dlopened, never a package dependency).
"${PIP[@]}" wheel -q --no-deps --no-build-isolation -w "$WHEELHOUSE" \
  --config-settings=build-dir="$OUT/native" --config-settings=cmake.define.KTD_CUDA="${KTD_CUDA:-AUTO}" "$ROOT"
if "$BUILD_VENV/bin/python" -c 'import sys, zipfile; sys.exit("ktd/libktd_cuda.so" not in zipfile.ZipFile(sys.argv[1]).namelist())' \
     "$WHEELHOUSE"/ktd-*.whl; then
  say "wheelhouse: the CUDA backend (ktd/libktd_cuda.so) is in the wheel"
else
  say "wheelhouse: no CUDA backend in the wheel (nvcc not found or KTD_CUDA=OFF)"
fi
fi

# --- 3. the package --------------------------------------------------------------------------
say "dpkg-buildpackage ktd $DEB_VERSION"
SRC=$OUT/src
rm -rf "$SRC" "$OUT"/ktd_*.deb "$OUT"/ktd_*.buildinfo "$OUT"/ktd_*.changes
mkdir -p "$SRC"
cp -r packaging/debian "$SRC/debian"
cp packaging/systemd/ktd.service packaging/systemd/ktd.socket "$SRC/debian/"
# The gateway's units: debian/<package>.<name>.<type> for dh_installsystemd --name=ktd-http.
cp packaging/systemd/ktd-http.service "$SRC/debian/ktd.ktd-http.service"
cp packaging/systemd/ktd-http.socket "$SRC/debian/ktd.ktd-http.socket"
cp -r packaging/man "$SRC/man"
cp packaging/make-venv.sh packaging/sysctl/60-ktd-hugepages.conf "$SRC/"
# The conffile: config/ktd.yaml with model.path set to the package's models directory.
sed 's|^  # path: /var/lib/ktd-models/model.gguf$|  path: /var/lib/ktd-models/model.gguf|' config/ktd.yaml >"$SRC/ktd.yaml"
grep -q '^  path: /var/lib/ktd-models/model.gguf$' "$SRC/ktd.yaml" || die "config/ktd.yaml: the model.path line was not found"
top=$(dpkg-parsechangelog -l packaging/debian/changelog -S Version)
if [ "$top" != "$DEB_VERSION" ]; then
  { printf 'ktd (%s) bookworm; urgency=medium\n\n  * Rebuild as %s (KTD_VERSION).\n\n -- %s  %s\n\n' \
      "$DEB_VERSION" "$DEB_VERSION" "$(dpkg-parsechangelog -l packaging/debian/changelog -S Maintainer)" "$(date -R)"
    cat packaging/debian/changelog; } >"$SRC/debian/changelog"
fi
if [ "$ARCH" = arm64 ]; then
  cp "$REQS" "$OUT/requirements-runtime.txt"
  arm64_dpkg_buildpackage
else
(cd "$SRC" && KTD_WHEELHOUSE="$WHEELHOUSE" KTD_REQUIREMENTS="$REQS" KTD_WHEEL_VERSION="$WHEEL_VERSION" \
   KTD_BUILD_PIP="$BUILD_VENV/bin/pip" dpkg-buildpackage -b -us -uc >"$OUT/dpkg-buildpackage.log" 2>&1)
fi || { tail -40 "$OUT/dpkg-buildpackage.log" >&2; die "dpkg-buildpackage failed (log: $OUT/dpkg-buildpackage.log)"; }
[ "$ARCH" = amd64 ] || arm64_compress_deb "$OUT/$DEB" "$SRC/debian/changelog"
mkdir -p "$DIST"
cp "$OUT/$DEB" "$DIST/$DEB"
say "$DIST/$DEB ($(du -h "$DIST/$DEB" | cut -f1)): $(dpkg-deb -f "$DIST/$DEB" Depends)"

# --- 4. offline bundle -----------------------------------------------------------------------
[ -z "${KTD_SKIP_BUNDLE:-}" ] || exit 0
[ "$(id -u)" = 0 ] || die "the bundle's closure is computed in a chroot: run as root (or KTD_SKIP_BUNDLE=1)"
debroot_base
BUNDLE=$DIST/ktd-bundle-$UPSTREAM_VERSION
say "bundle: Depends closure on a minimal Debian 12 -> $BUNDLE"
root=$(debroot_new "$OUT")
trap 'debroot_remove "$root"' EXIT
cp "$DIST/$DEB" "$root/tmp/"
if [ "$ARCH" = amd64 ]; then
chroot "$root" apt-get update -qq >/dev/null
chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -qq -y --download-only \
  --no-install-recommends "/tmp/$DEB" >"$OUT/bundle.log" 2>&1
else
  arm64_bundle_download "$root" "/tmp/$DEB" >"$OUT/bundle.log" 2>&1
fi || { cat "$OUT/bundle.log" >&2; die "apt-get --download-only failed"; }
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
cp "$root"/var/cache/apt/archives/*.deb "$BUNDLE/"
cp "$DIST/$DEB" "$BUNDLE/"
cat >"$BUNDLE/README" <<EOF
ktd $DEB_VERSION for Debian 12 (bookworm, $ARCH), offline.
This directory holds ktd and the Debian packages it needs that a minimal Debian 12 lacks.
Install (as root, no network needed):  dpkg -i *.deb
Then put the model at /var/lib/ktd-models/model.gguf (or edit /etc/ktd/ktd.yaml) and
run: systemctl restart ktd   (see man ktd)
EOF
(cd "$BUNDLE" && sha256sum ./*.deb >SHA256SUMS)
say "bundle: $(ls "$BUNDLE"/*.deb | wc -l) packages, $(du -sh "$BUNDLE" | cut -f1)"
