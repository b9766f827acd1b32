#!/bin/bash
# Install the self-contained /opt/ktd environment into a staging tree, offline, from the wheelhouse
# (called by debian/rules as `make-venv.sh $(CURDIR)/debian/ktd`). The pitfalls it avoids
# (docs/OPERATIONS.md, "The Debian package"): the venv is created by Debian's /usr/bin/python3.11
# (the interpreter the package depends on), bin/python* stay symlinks to it, nothing may mention
# the staging path, and every module is byte-compiled here because the service cannot write
# __pycache__ under ProtectSystem=strict.
#
# Environment: KTD_WHEELHOUSE (directory of wheels), KTD_REQUIREMENTS (pinned runtime list),
# KTD_WHEEL_VERSION (ktd's version inside the wheelhouse), KTD_BUILD_PIP (a pip that runs
# `--python`; the build venv's).
set -euo pipefail
STAGE=${1:?usage: make-venv.sh STAGE_DIR}
: "${KTD_WHEELHOUSE:?}" "${KTD_REQUIREMENTS:?}" "${KTD_WHEEL_VERSION:?}" "${KTD_BUILD_PIP:?}"
PREFIX=/opt/ktd
VENV=$STAGE$PREFIX
PYTHON=/usr/bin/python3.11

rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv --without-pip "$VENV"
# --no-index: nothing is downloaded here; a wheel missing from the wheelhouse is an error.
"$KTD_BUILD_PIP" --python "$VENV/bin/python" install --quiet --no-index --find-links "$KTD_WHEELHOUSE" \
  --no-compile --no-warn-script-location -r "$KTD_REQUIREMENTS" "ktd[systemd]==$KTD_WHEEL_VERSION"
"$KTD_BUILD_PIP" --python "$VENV/bin/python" check

# Relocate: console scripts (regular text files only: sed -i would replace the python symlinks
# with interpreter copies), activate scripts, pyvenv.cfg's `command =` line, pip's records.
find "$VENV/bin" -type f -exec grep -lIZ -- "$STAGE" {} + | xargs -0 -r sed -i "s#$STAGE$PREFIX#$PREFIX#g"
sed -i "s#$STAGE$PREFIX#$PREFIX#g" "$VENV/pyvenv.cfg"
find "$VENV/lib" -name direct_url.json -delete
find "$VENV/lib" -name RECORD -exec sed -i "s#$STAGE$PREFIX#$PREFIX#g" {} +
# The activate scripts are for interactive shells; the package's users run /usr/bin/ktd.
rm -f "$VENV"/bin/activate*  "$VENV"/bin/Activate.ps1
for link in python python3 python3.11; do
  [ -L "$VENV/bin/$link" ] || { echo "make-venv: bin/$link is not a symlink" >&2; exit 1; }
done
[ "$(readlink -f "$VENV/bin/python3.11")" = "$PYTHON" ] || { echo "make-venv: bin/python3.11 does not resolve to $PYTHON" >&2; exit 1; }

# Byte-compile with the final paths in co_filename; unchecked-hash: the .pyc is used without
# stat'ing the source (the files are read-only, owned by the package).
"$PYTHON" -m compileall -q -j0 --invalidation-mode unchecked-hash -s "$STAGE" -p / "$VENV/lib" >/dev/null

# Shared objects from wheels are not executables (lintian shared-library-is-executable).
find "$VENV/lib" -name '*.so*' -type f -exec chmod 0644 {} +

# A RUNPATH may only point inside the package ($ORIGIN): anything else is a build machine's path.
if bad=$(find "$VENV/lib" -name '*.so*' -type f -exec sh -c 'readelf -d "$1" | grep -E "R(UN)?PATH" | grep -v "\[\$ORIGIN[^]:]*\]" | sed "s#^#$1: #"' _ {} \; | grep .); then
  echo "make-venv: shared objects with a RUNPATH outside the package:" >&2; echo "$bad" >&2; exit 1
fi
if leaks=$(grep -rIl -- "$STAGE" "$VENV"); then
  echo "make-venv: the staging path leaks into:" >&2; echo "$leaks" >&2; exit 1
fi
if grep -rl --include='*.pyc' -a -- "$STAGE" "$VENV" >/dev/null; then
  echo "make-venv: the staging path leaks into byte-compiled files" >&2; exit 1
fi
