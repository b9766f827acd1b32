#!/bin/bash
# make test-deb: checks of the package built by `make deb` (docs/OPERATIONS.md: "The Debian
# package", "systemd units").
#   lintian              no errors (overrides carry a comment saying why)
#   install (offline)    the bundle into a minimal Debian 12 root under `unshare -n`
#   serve                the installed daemon as user ktd on a tiny generated model; the installed
#                        ktctl's greedy text equals the engine's in-process greedy text; the
#                        installed gateway (ktd-http, user ktd-http) answers /v1/models and its
#                        /v1/completions text equals it too, over loopback
#   cuda                 libktd_cuda.so (when built with nvcc) loads in the root, which has no
#                        NVIDIA driver, and cuda_status() reports the driver reason
#   upgrade              to a rebuilt newer version, with an edited conffile (edit kept)
#   remove / purge       /etc/ktd gone after purge; the model and the ktd user kept
#   units                systemd-analyze verify (any output fails) and security (exposure <= 1.0)
#                        on the installed units, in a Debian 12 root with systemd
#   boot                 systemd-nspawn -b of that root: ktd.socket/ktd.service for real
#                        (READY, socket activation, reload), and ktd-http.socket/.service
#                        (disabled by default; enabled, /v1/models answers on 127.0.0.1:11435),
#                        skipped with the reason if nspawn cannot boot here
#   piuparts             install/purge test (KTD_SKIP_PIUPARTS=1 skips it)
# KTD_DEB_ARCH=arm64 (`make test-deb ARCH=arm64`): the arm64 package in an arm64 Debian 12 root
# under qemu-user-static (binfmt_misc): lintian, offline install, serve (as above), remove/purge;
# upgrade, units, boot and piuparts are amd64-only (skipped with the reason: the package's
# maintainer scripts and units are the same files; systemd does not run under qemu-user).
# Prints PASS/FAIL/SKIP per check, exits 1 if any check failed. Needs root (chroot, mounts,
# unshare) and the Debian mirror for the tools and the roots (the install itself is offline).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ARCH=${KTD_DEB_ARCH:-amd64}
case $ARCH in amd64|arm64) ;; *) echo "test-deb: ARCH=$ARCH: only amd64 and arm64" >&2; exit 2 ;; esac
export DEBROOT_ARCH=$ARCH
. packaging/debroot.sh

WHEEL_VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
VERSION=${KTD_VERSION:-$WHEEL_VERSION}
DEB=$ROOT/dist/ktd_${VERSION}~deb12_${ARCH}.deb
BUNDLE=$ROOT/dist/ktd-bundle-$VERSION
NEW_VERSION=$VERSION+test1
WORK=$ROOT/build/deb-test
[ "$ARCH" = amd64 ] || WORK=$ROOT/build/deb-test-$ARCH
# Seconds the daemon may take to listen (emulated arm64: imports and model load run under qemu).
START_S=60
[ "$ARCH" = amd64 ] || START_S=600
LOGS=$WORK/logs

n_fail=0
declare -a SUMMARY=()
pass() { echo "PASS: $1"; SUMMARY+=("PASS: $1"); }
fail() { echo "FAIL: $1"; SUMMARY+=("FAIL: $1"); n_fail=$((n_fail + 1)); }
skip() { echo "SKIP: $1"; SUMMARY+=("SKIP: $1"); }
# check NAME COMMAND...: PASS if the command exits 0; its output goes to $LOGS/NAME.log and is
# shown on failure. The command runs in a subshell outside any `if`, so that the `set -e` of a
# check function takes effect (bash ignores it in a condition) and ends only that check.
check() {
  local name=$1 log=$LOGS/${1//[^A-Za-z0-9_.-]/_}.log rc
  shift
  ( "$@" ) >"$log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then pass "$name"; else fail "$name (log: $log)"; sed 's/^/    /' "$log" | tail -25; fi
}
finish() {
  echo
  echo "== test-deb summary"
  printf '%s\n' "${SUMMARY[@]}"
  if [ "$n_fail" -gt 0 ]; then echo "test-deb: $n_fail check(s) FAILED"; exit 1; fi
  echo "test-deb: all checks passed"
  exit 0
}

[ "$(id -u)" = 0 ] || { echo "test-deb: needs root (chroot, mounts, unshare)" >&2; exit 2; }
[ -f "$DEB" ] && [ -d "$BUNDLE" ] || { echo "test-deb: $DEB or $BUNDLE missing: run make deb" >&2; exit 2; }
rm -rf "$WORK"
mkdir -p "$LOGS"

need=()
pkgs=(lintian debootstrap piuparts systemd systemd-container)
[ "$ARCH" = amd64 ] || pkgs=(lintian mmdebstrap arch-test qemu-user-static binfmt-support)
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "== apt-get install ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || { echo "test-deb: cannot install ${need[*]}" >&2; exit 2; }
fi
[ "$ARCH" = amd64 ] || tools/arm64/binfmt.sh || { echo "test-deb: no binfmt_misc entry for qemu-aarch64" >&2; exit 2; }
debroot_base || { echo "test-deb: no Debian 12 base root" >&2; exit 2; }

ROOTS=()
cleanup() { local r; for r in "${ROOTS[@]}"; do debroot_remove "$r"; done; }
trap cleanup EXIT

# ---- lintian ----------------------------------------------------------------------------------
lintian_check() {
  # (with --show-overrides, overridden errors would count for --fail-on)
  lintian --fail-on error --display-level '>=warning' "$DEB"
  local rc=$?
  echo "(errors: $(grep -c '^E:' "$LOGS/lintian.log" 2>/dev/null), warnings: $(grep -c '^W:' "$LOGS/lintian.log" 2>/dev/null); overrides with reasons: packaging/debian/ktd.lintian-overrides)"
  return $rc
}
check lintian lintian_check
grep -E '^(E|W):' "$LOGS/lintian.log" | sed 's/^/    /'

# ---- offline install into a minimal Debian 12 ------------------------------------------------
# (the version has no Debian revision, i.e. a native package: its changelog is changelog.gz)
R=$(debroot_new "$WORK"); ROOTS+=("$R")
debroot_mount "$R"
in_root() { unshare -n chroot "$R" "$@"; }       # network cut for everything in the root
mkdir -p "$R/tmp/bundle"
cp "$BUNDLE"/*.deb "$R/tmp/bundle/"

check "install: dpkg -i bundle/*.deb offline ($(ls "$BUNDLE"/*.deb | wc -l) packages)" \
  in_root sh -c 'dpkg -i /tmp/bundle/*.deb && [ "$(dpkg-query -W -f="\${Status}" ktd)" = "install ok installed" ]'
installed_layout() {
  set -e
  in_root getent passwd ktd
  in_root getent group ktd
  in_root getent passwd ktd-http
  in_root id -nG ktd-http | tr ' ' '\n' | grep -qx ktd
  for f in /usr/bin/ktd /usr/bin/ktctl /opt/ktd/bin/python3.11 /etc/ktd/ktd.yaml \
           /etc/sysctl.d/60-ktd-hugepages.conf /lib/systemd/system/ktd.service /lib/systemd/system/ktd.socket \
           /usr/bin/ktd-http /lib/systemd/system/ktd-http.service /lib/systemd/system/ktd-http.socket \
           /usr/share/man/man8/ktd-http.8.gz /usr/share/man/man8/ktd.8.gz /usr/share/man/man1/ktctl.1.gz /usr/share/doc/ktd/copyright \
           /usr/share/doc/ktd/changelog.gz; do
    in_root test -e "$f" || { echo "missing $f"; return 1; }
  done
  [ "$(readlink "$R/opt/ktd/bin/python3.11")" = /usr/bin/python3.11 ]
  [ "$(in_root stat -c '%U:%G %a' /var/lib/ktd-models)" = "root:ktd 750" ]
  grep -q '^  path: /var/lib/ktd-models/model.gguf$' "$R/etc/ktd/ktd.yaml"
  grep -qx /etc/ktd/ktd.yaml "$R/var/lib/dpkg/info/ktd.conffiles"
  in_root ktd --version
  in_root ktd config check -q /etc/ktd/ktd.yaml
}
check "install: users ktd and ktd-http (in group ktd), files, conffiles, models dir root:ktd 0750, ktd --version" installed_layout

# The optional CUDA backend (libktd_cuda.so, cudart linked statically): shipped when the package
# was built where nvcc was found. This root has no NVIDIA driver: the library must load (all its
# dependencies present) and cuda_status() must give the runtime's reason, not a load failure;
# ktd inspect says the same on one line.
CUDA_LIB=/opt/ktd/lib/python3.11/site-packages/ktd/libktd_cuda.so
cuda_backend() {
  set -e
  in_root test -f "$CUDA_LIB"
  in_root ldd "$CUDA_LIB"
  if in_root ldd "$CUDA_LIB" | grep -Eq 'not found|libcudart|libcuda\.so'; then
    echo "libktd_cuda.so: a dependency missing, or cudart/libcuda linked dynamically"; return 1
  fi
  in_root /opt/ktd/bin/python -c '
import sys
from ktd import _native
s = _native.cuda_status()
print(s)
assert s["library"] == sys.argv[1], s
assert not s["available"] and s["devices"] == 0, s
assert "cannot be loaded" not in s["reason"] and "not a ktd CUDA backend" not in s["reason"], s
assert "driver" in s["reason"].lower(), s
' "$CUDA_LIB"
}
# grep reads the whole listing (not -q): under pipefail an early exit kills dpkg-deb with SIGPIPE
# and the pipeline fails although the file is there.
if dpkg-deb -c "$DEB" | grep '/ktd/libktd_cuda\.so$' >/dev/null; then
  check "cuda: libktd_cuda.so shipped, loads without an NVIDIA driver, cuda_status() gives the driver reason" cuda_backend
else
  skip "cuda: the package has no libktd_cuda.so (built where nvcc was not found)"
fi

# A tiny model, generated in the root by the installed interpreter (numpy + gguf of /opt/ktd)
# with the build tree's generator.
cp tests/models/tiny_dense.py "$R/tmp/tiny_dense.py"
make_model() {
  set -e
  in_root env PYTHONDONTWRITEBYTECODE=1 /opt/ktd/bin/python /tmp/tiny_dense.py --arch llama --wtype Q8_0 --out /tmp/models
  in_root install -m 0640 -o root -g ktd /tmp/models/tiny-llama-Q8_0-s0.gguf /var/lib/ktd-models/model.gguf
}
check "model: tiny llama Q8_0 generated into /var/lib/ktd-models/model.gguf" make_model

# The daemon as user ktd (no systemd in this root: it binds /run/ktd/ktd.sock itself).
# The daemon's pid is kept in a file: checks run in subshells, and a failed one leaves it running
# for kill_daemon.
PIDFILE=$WORK/daemon.pid
kill_daemon() {
  [ -s "$PIDFILE" ] || return 0
  kill -KILL "$(cat "$PIDFILE")" 2>/dev/null
  rm -f "$PIDFILE"
}
start_daemon() {
  mkdir -p "$R/run/ktd"
  in_root chown ktd:ktd /run/ktd
  rm -f "$R/run/ktd/ktd.sock"
  unshare -n chroot "$R" setpriv --reuid=ktd --regid=ktd --init-groups --reset-env \
    env KTD_MODEL__N_CTX=256 KTD_MODEL__N_SEQ_MAX=2 KTD_MODEL__THREADS=1 \
    /usr/bin/ktd serve --config /etc/ktd/ktd.yaml >"$LOGS/daemon-$1.log" 2>&1 &
  echo $! >"$PIDFILE"
  local i
  for i in $(seq $((START_S * 10))); do
    [ -S "$R/run/ktd/ktd.sock" ] && return 0
    kill -0 "$(cat "$PIDFILE")" 2>/dev/null || { cat "$LOGS/daemon-$1.log"; return 1; }
    sleep 0.1
  done
  cat "$LOGS/daemon-$1.log"; return 1
}
stop_daemon() {
  local pid rc
  pid=$(cat "$PIDFILE")
  kill -TERM "$pid"
  wait "$pid"
  rc=$?
  rm -f "$PIDFILE"
  echo "daemon exit status $rc"
  return $rc
}
# Greedy text of the engine in-process (the same code the daemon serves, no scheduler/socket).
cat >"$R/tmp/greedy.py" <<'EOF'
import sys
import numpy as np
from ktd.server.engine import Engine
from ktd.text.tokenizer import Tokenizer

path, prompt, n_max = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = Tokenizer.from_gguf(path)
eng = Engine.open(path, n_ctx=256, n_seq_max=1, threads=1)
ids = tok.encode(prompt, add_special=True)
out, pos, batch = [], 0, ids
for _ in range(n_max):
    n = len(batch)
    logits = eng.forward(np.array(batch, np.int32), np.arange(pos, pos + n, dtype=np.int32),
                         np.zeros(n, np.int32), np.eye(1, n, n - 1, dtype=bool)[0])
    pos += n
    nxt = int(np.argmax(logits[-1]))
    if nxt in tok.eos_ids:
        break
    out.append(nxt)
    batch = [nxt]
sys.stdout.write(tok.decode(out))
EOF
# The gateway as user ktd-http (group ktd) in the root, on a loopback port the kernel picks (the
# host's network namespace: the daemon's `unshare -n` has no loopback up; the Unix socket path
# reaches it from any namespace). It prints its base URL on a line of its own.
gateway_query() {
  set -e
  local tag=$1 want=$2 gpid url i
  chroot "$R" setpriv --reuid=ktd-http --regid=ktd-http --init-groups --reset-env \
    /usr/bin/ktd-http --socket /run/ktd/ktd.sock --listen 127.0.0.1:0 \
    >"$WORK/gateway-$tag.out" 2>"$LOGS/gateway-$tag.log" &
  gpid=$!
  for i in $(seq $((START_S * 5))); do
    url=$(grep -m1 '^http://127.0.0.1:[0-9]*/v1$' "$WORK/gateway-$tag.out" || true)
    [ -n "$url" ] && break
    kill -0 $gpid 2>/dev/null || { cat "$LOGS/gateway-$tag.log"; return 1; }
    sleep 0.1
  done
  echo "gateway: $url"
  /usr/bin/python3 - "$url" "$want" <<'PYEOF' || { kill $gpid; cat "$LOGS/gateway-$tag.log"; return 1; }
import json, sys, urllib.request
url, want = sys.argv[1], sys.argv[2]
models = json.load(urllib.request.urlopen(url + "/models", timeout=60))
print("GET /v1/models:", json.dumps(models))
assert models["data"][0]["id"] == "model", models
req = urllib.request.Request(url + "/completions", headers={"Content-Type": "application/json"},
                             data=json.dumps({"model": "model", "prompt": "hello world", "max_tokens": 8,
                                              "temperature": 0}).encode())
text = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]
print("POST /v1/completions:", repr(text))
assert text == want, (text, want)
PYEOF
  kill -TERM $gpid
  wait $gpid
  echo "gateway exit status $?"
}
serve_and_query() {
  set -e
  local tag=$1
  start_daemon "$tag"
  [ "$(in_root stat -c '%G %a' /run/ktd/ktd.sock)" = "ktd 660" ] || { in_root stat /run/ktd/ktd.sock; return 1; }
  in_root ktctl -s /run/ktd/ktd.sock health --wait  # the daemon accepts while it loads
  got=$(in_root ktctl -s /run/ktd/ktd.sock generate "hello world" -n 8 -t 0 --no-stream)
  want=$(in_root env PYTHONDONTWRITEBYTECODE=1 /opt/ktd/bin/python /tmp/greedy.py \
           /var/lib/ktd-models/model.gguf "hello world" 8)
  echo "ktctl generate: $(printf %q "$got")"
  echo "in-process:     $(printf %q "$want")"
  [ -n "$want" ]
  [ "$got" = "$want" ]
  in_root ktctl -s /run/ktd/ktd.sock status >"$WORK/status-$tag.json"
  cat "$WORK/status-$tag.json"
  /usr/bin/python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); assert s["model"]["architecture"] == "llama", s' \
    "$WORK/status-$tag.json"
  gateway_query "$tag" "$want"
  stop_daemon
}
check "serve: daemon as ktd, ktctl health/generate/status (greedy text = in-process engine), ktd-http as ktd-http: /v1/models, /v1/completions (same text), SIGTERM exit 0" \
  serve_and_query v1
kill_daemon

# ---- upgrade with an edited conffile -----------------------------------------------------------
if [ "$ARCH" != amd64 ]; then
  skip "upgrade: amd64 only (the same maintainer scripts and conffile; a rebuild under emulation takes minutes)"
else
edit_conffile() {
  set -e
  sed -i 's/^  # n_ctx: 4096$/  n_ctx: 512  # edited by test-deb/' "$R/etc/ktd/ktd.yaml"
  grep -q 'edited by test-deb' "$R/etc/ktd/ktd.yaml"
}
check "upgrade: edit /etc/ktd/ktd.yaml (model.n_ctx: 512)" edit_conffile
NEW_DIST=$WORK/dist
rebuild() { KTD_VERSION=$NEW_VERSION KTD_SKIP_BUNDLE=1 KTD_DIST=$NEW_DIST packaging/build-deb.sh; }
check "upgrade: rebuild as $NEW_VERSION~deb12" rebuild
NEW_DEB=$NEW_DIST/ktd_${NEW_VERSION}~deb12_amd64.deb
upgrade() {
  set -e
  cp "$NEW_DEB" "$R/tmp/"
  in_root dpkg -i "/tmp/$(basename "$NEW_DEB")"
  [ "$(in_root dpkg-query -W -f='${Status} ${Version}' ktd)" = "install ok installed $NEW_VERSION~deb12" ]
  grep -q 'n_ctx: 512  # edited by test-deb' "$R/etc/ktd/ktd.yaml"
  [ ! -e "$R/etc/ktd/ktd.yaml.dpkg-dist" ]
  [ ! -e "$R/etc/ktd/ktd.yaml.dpkg-old" ]
  in_root ktd config check /etc/ktd/ktd.yaml | grep -q 'n_ctx: 512'
}
check "upgrade: dpkg -i $NEW_VERSION~deb12 offline, conffile edit kept" upgrade
check "upgrade: the upgraded daemon serves" serve_and_query v2
kill_daemon
cp "$R/var/lib/ktd-models/model.gguf" "$WORK/model.gguf"   # for the systemd root below
fi

# ---- remove and purge -------------------------------------------------------------------------
remove() {
  set -e
  in_root dpkg -r ktd
  [ "$(in_root dpkg-query -W -f='${Status}' ktd)" = "deinstall ok config-files" ]
  [ ! -e "$R/opt/ktd" ]
  [ ! -L "$R/usr/bin/ktd" ]
  [ ! -L "$R/usr/bin/ktctl" ]
  [ -f "$R/etc/ktd/ktd.yaml" ]
  [ -f "$R/var/lib/ktd-models/model.gguf" ]
}
check "remove: /opt/ktd and commands gone; config and model kept" remove
purge() {
  set -e
  in_root dpkg -P ktd
  local st
  st=$(in_root dpkg-query -W -f='${Status}' ktd 2>/dev/null || true)
  [ -z "$st" ] || [ "$st" = "unknown ok not-installed" ]
  [ ! -e "$R/etc/ktd" ]
  [ ! -e "$R/etc/sysctl.d/60-ktd-hugepages.conf" ]
  [ ! -e "$R/var/lib/ktd" ]
  [ -z "$(in_root dpkg-statoverride --list /var/lib/ktd-models)" ]
  [ -f "$R/var/lib/ktd-models/model.gguf" ]
  in_root getent passwd ktd
}
check "purge: /etc/ktd, drop-in, state gone; model and user ktd kept" purge
debroot_remove "$R"; ROOTS=()
if [ "$ARCH" != amd64 ]; then
  skip "units, boot: amd64 only (the same unit files; systemd does not run under qemu-user)"
  skip "piuparts: amd64 only (install/purge are checked above)"
  finish
fi

# ---- units: verify, security, boot ------------------------------------------------------------
S=$(debroot_new "$WORK"); ROOTS+=("$S")
debroot_mount "$S"
systemd_root() {
  set -e
  chroot "$S" apt-get update -qq
  chroot "$S" env DEBIAN_FRONTEND=noninteractive apt-get install -qq -y --no-install-recommends systemd systemd-sysv
  cp "$BUNDLE"/*.deb "$S/tmp/"
  unshare -n chroot "$S" sh -c 'dpkg -i /tmp/*.deb'
  install -m 0640 -g "$(chroot "$S" getent group ktd | cut -d: -f3)" "$WORK/model.gguf" "$S/var/lib/ktd-models/model.gguf"
}
check "units: Debian 12 root with systemd (mirror) + the bundle (offline)" systemd_root
verify_units() {
  local out
  out=$(unshare -n chroot "$S" systemd-analyze verify --man=no ktd.socket ktd.service ktd-http.socket ktd-http.service 2>&1)
  local rc=$?
  echo "rc=$rc output: $out"
  [ $rc = 0 ] && [ -z "$out" ]
}
check "units: systemd-analyze verify on the installed units (ktd, ktd-http) prints nothing" verify_units
security_http() {
  local level
  level=$(unshare -n chroot "$S" systemd-analyze security --offline=yes --no-pager ktd-http.service 2>&1 \
    | sed -n 's/.*Overall exposure level for ktd-http.service: \([0-9.]*\).*/\1/p')
  echo "exposure: ${level:-none}"
  [ -n "$level" ] && awk -v l="$level" 'BEGIN { exit !(l <= 1.0) }'
}
check "units: systemd-analyze security ktd-http.service exposure <= 1.0" security_http
security() {
  unshare -n chroot "$S" systemd-analyze security --offline=yes --no-pager ktd.service 2>&1 | tail -3
  local level
  level=$(unshare -n chroot "$S" systemd-analyze security --offline=yes --no-pager ktd.service 2>&1 \
    | sed -n 's/.*Overall exposure level for ktd.service: \([0-9.]*\).*/\1/p')
  echo "exposure: ${level:-none}"
  [ -n "$level" ] && awk -v l="$level" 'BEGIN { exit !(l <= 1.0) }'
}
check "units: systemd-analyze security ktd.service exposure <= 1.0 ($(unshare -n chroot "$S" systemd-analyze security --offline=yes --no-pager ktd.service 2>&1 | sed -n 's/.*Overall exposure level for ktd.service: \([0-9.]*\).*/\1/p'))" security

# Boot the root with systemd as PID 1: a oneshot unit runs the checks and powers off.
cat >"$S/usr/local/sbin/ktd-selftest" <<'EOF'
#!/bin/sh
# Runs inside the booted container; the report is read by test-deb.sh.
exec >/var/log/ktd-selftest.log 2>&1
set -x
ok=1
wait_active() { for i in $(seq 300); do systemctl is-active -q "$1" && return 0; sleep 0.2; done; return 1; }
wait_active ktd.service || ok=0
systemctl show -p ActiveState -p SubState -p StatusText -p MainPID -p NRestarts ktd.service
systemctl show -p StatusText --value ktd.service | grep -q '^serving' || ok=0
[ "$(stat -c '%U:%G %a' /run/ktd/ktd.sock)" = "root:ktd 660" ] || ok=0
ktctl status || ok=0
[ -n "$(ktctl generate 'hello world' -n 8 -t 0 --no-stream)" ] || ok=0
# socket activation: with the service stopped, a client connection starts it
systemctl stop ktd.service
systemctl is-active -q ktd.service && ok=0
systemctl is-active -q ktd.socket || ok=0
ktctl --timeout 120 health --wait || ok=0
systemctl is-active -q ktd.service || ok=0
# reload: SIGHUP -> RELOADING=1 ... READY=1
systemctl reload ktd.service || ok=0
sleep 1
systemctl show -p StatusText --value ktd.service
systemctl is-active -q ktd.service || ok=0
journalctl -b -u ktd.service --no-pager | tail -20
# the HTTP gateway: installed disabled; enabled, its socket starts it on the first request
[ "$(systemctl is-enabled ktd-http.socket)" = disabled ] || ok=0
systemctl is-active -q ktd-http.socket && ok=0
systemctl enable --now ktd-http.socket || ok=0
/opt/ktd/bin/python -c '
import json, urllib.request
m = json.load(urllib.request.urlopen("http://127.0.0.1:11435/v1/models", timeout=120))
print(m)
assert m["data"][0]["id"] == "model"
' || ok=0
systemctl is-active -q ktd-http.service || ok=0
systemctl show -p ActiveState -p StatusText ktd-http.service
journalctl -b -u ktd-http.service --no-pager | tail -10
[ $ok = 1 ] && echo SELFTEST-PASS || echo SELFTEST-FAIL
systemctl poweroff --no-block
EOF
chmod 0755 "$S/usr/local/sbin/ktd-selftest"
cat >"$S/etc/systemd/system/ktd-selftest.service" <<'EOF'
[Unit]
Description=ktd package self-test (test-deb.sh)
After=multi-user.target ktd.socket

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/ktd-selftest

[Install]
WantedBy=multi-user.target
EOF
ln -sf /etc/systemd/system/ktd-selftest.service "$S/etc/systemd/system/multi-user.target.wants/ktd-selftest.service"
# Smaller context for the tiny model; the shipped unit is untouched (a drop-in, as an admin would).
mkdir -p "$S/etc/systemd/system/ktd.service.d"
printf '[Service]\nEnvironment=KTD_MODEL__N_CTX=256 KTD_MODEL__N_SEQ_MAX=2 KTD_MODEL__THREADS=1\n' \
  >"$S/etc/systemd/system/ktd.service.d/test.conf"
debroot_umount "$S"
boot() {
  timeout 300 systemd-nspawn -q -D "$S" -b --register=no --keep-unit --private-network --capability=CAP_IPC_LOCK \
    >"$LOGS/nspawn.log" 2>&1
  local rc=$?
  echo "systemd-nspawn rc=$rc"
  cat "$S/var/log/ktd-selftest.log" 2>/dev/null
  grep -q SELFTEST-PASS "$S/var/log/ktd-selftest.log" 2>/dev/null
}
if [ -n "${KTD_SKIP_BOOT:-}" ]; then
  skip "boot: systemd-nspawn -b (KTD_SKIP_BOOT set)"
else
  check "boot: systemd-nspawn -b: ktd.service READY (Type=notify), socket root:ktd 0660, socket activation, reload; ktd-http.socket disabled by default, enabled: /v1/models over loopback" boot
  if ! grep -q 'selftest' "$LOGS/nspawn.log" 2>/dev/null && [ ! -f "$S/var/log/ktd-selftest.log" ]; then
    echo "    (nspawn did not reach the self-test: $(head -3 "$LOGS/nspawn.log" | tr '\n' ' '))"
  fi
fi
debroot_remove "$S"; ROOTS=()

# ---- piuparts ---------------------------------------------------------------------------------
if [ -n "${KTD_SKIP_PIUPARTS:-}" ]; then
  skip "piuparts (KTD_SKIP_PIUPARTS set)"
else
  # /opt belongs to no package: the first package shipping ./opt/ owns it (OPS.md section 4).
  check "piuparts: install/purge in a minimal Debian 12" \
    piuparts --basetgz="$BASE_TGZ" -d bookworm -m "$DEBIAN_MIRROR" --no-upgrade-test \
      --ignore=/opt/ --tmpdir="$WORK" "$DEB"
fi

finish
