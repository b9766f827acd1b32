#!/bin/bash
# Prepare what `make gpu-check` needs on a GPU machine that cannot reach PyPI, may run another
# Python (3.12) and may lack gguf: a wheelhouse under build/gpu-carry/wheels for the CPython
# versions in $PYVERS (default 3.12: about 52 MB with cmake, small enough to copy to a device
# machine along with the checkout; each more version adds ~18 MB) on x86-64, with the pins of
# requirements-dev.txt and only what building ktd._native and running the cuda tests import. Run
# it where PyPI is reachable; carry build/gpu-carry (and, when the device runs this Python, the
# in-place daemon/ktd/*.so).
set -euo pipefail
cd "$(dirname "$0")/../.."
# The Python whose pip downloads the wheels: the checkout's .venv when there is one (`make gpu-carry`
# passes it), else python3.
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=build/gpu-carry/wheels
rm -rf "$OUT"
mkdir -p "$OUT"
pin() { grep -iE "^$1==" requirements-dev.txt packaging/requirements-runtime.txt | head -1 | cut -d: -f2; }
pure=("$(pin gguf)" "$(pin pytest)" "$(pin pybind11)" "$(pin tqdm)" "$(pin requests)" "$(pin urllib3)" "$(pin idna)"
      "$(pin certifi)" iniconfig pluggy packaging)
binary=("$(pin numpy)" "$(pin PyYAML)" "$(pin msgpack)" "$(pin cmake)" "$(pin ninja)" "$(pin charset-normalizer)")
"$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$OUT" "${pure[@]}"
for v in ${PYVERS:-3.12}; do
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$v" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT" "${binary[@]}"
done
du -sh "$OUT"
ls "$OUT"
