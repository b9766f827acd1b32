# ktd — developer entry points. `make build`, `make test`, `make run` work on a fresh machine.
SHELL      := /bin/bash
PYTHON_SYS ?= python3.11
VENV       := .venv
PY         := $(VENV)/bin/python
PIP        := $(VENV)/bin/pip
BUILD_DIR  := build/dev
# CI sets KTD_WERROR=ON (warnings are errors); release flags always.
KTD_WERROR ?= OFF
NATIVE_SRCS := $(shell find native -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null) CMakeLists.txt
PYTEST_ARGS ?=

.PHONY: gpu-check gpu-carry build native venv test test-fast fuzz run demo fetch-models bench bench-kernels bench-decode bench-sampling bench-load bench-daemon synthetic-moe synthetic-dense synthetic-dram clean distclean wheel oracle deb test-deb test-arm64 test-arm64-ci

build: native

venv: $(VENV)/.stamp
$(VENV)/.stamp: requirements-dev.txt pyproject.toml
	# systemd-python builds from its sdist against libsystemd (docs/OPERATIONS.md, "systemd-python").
	if ! pkg-config --exists libsystemd 2>/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libsystemd-dev pkg-config >/dev/null; fi
	$(PYTHON_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-dev.txt
	# Install ktd into the venv in development mode: the package directory is put on the path
	# (the native module is built in place by `make native`), plus the `ktd` console script.
	$(PY) -c 'import site,sys; open(site.getsitepackages()[0]+"/ktd-dev.pth","w").write(sys.argv[1]+"\n")' "$(CURDIR)/daemon"
	printf '#!/bin/sh\nexec "$$(dirname "$$0")/python" -m ktd "$$@"\n' > $(VENV)/bin/ktd && chmod +x $(VENV)/bin/ktd
	printf '#!/bin/sh\nexec "$$(dirname "$$0")/python" -c "import sys; from ktd.ctl import main; sys.exit(main())" "$$@"\n' > $(VENV)/bin/ktctl && chmod +x $(VENV)/bin/ktctl
	touch $@

native: $(BUILD_DIR)/.stamp
$(BUILD_DIR)/.stamp: $(VENV)/.stamp $(NATIVE_SRCS)
	$(VENV)/bin/cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_MAKE_PROGRAM=$(CURDIR)/$(VENV)/bin/ninja \
	  -DKTD_INPLACE=ON -DKTD_WERROR=$(KTD_WERROR) -DPython_EXECUTABLE=$(CURDIR)/$(PY) \
	  -Dpybind11_DIR=$$($(PY) -m pybind11 --cmakedir) >/dev/null
	$(VENV)/bin/cmake --build $(BUILD_DIR) --parallel
	touch $@

# llama.cpp (llama-cpp-python) as the reference for the fidelity tests; the wheel is built once
# into $${KTD_CACHE:-~/.cache/ktd}/wheels (several minutes), later runs only install it.
oracle: venv
	tools/oracle.sh $(PY)

# --durations=25: the slowest tests close the output, to see where the suite's time goes.
test: build oracle
	$(PY) -m pytest --durations=25 $(PYTEST_ARGS)

# Tests without the slow/real-model ones (quick inner loop).
test-fast: build
	$(PY) -m pytest -m "not slow and not realmodel" $(PYTEST_ARGS)

# The README's first command: fetch the default model (SHA-256 verified into the cache if absent)
# and serve it with the daemon in the foreground on ./run/ktd.sock, with the HTTP gateway
# (ktd-http, OpenAI and Ollama APIs) beside it on 127.0.0.1:$(HTTP_PORT); the gateway prints its
# base URL on a line of its own once it listens. No root needed; Ctrl-C stops both (so does either
# one exiting). MODEL=<known name> picks another model (`ktd fetch --list`); KTD_<SECTION>__<KEY>
# environment variables override configuration keys (`ktd config explain`).
MODEL ?= qwen2.5-coder-0.5b
RUN_SOCKET := run/ktd.sock
HTTP_PORT ?= 11435
run: build
	@mkdir -p run
	@path=$$($(PY) -m ktd fetch $(MODEL)) || exit 1; \
	echo "ktd: serving $$path on $(RUN_SOCKET); in another terminal try:"; \
	echo "  .venv/bin/ktctl -s $(RUN_SOCKET) chat -m 'Write a Python function that checks whether a number is prime.'"; \
	echo "  curl -s http://127.0.0.1:$(HTTP_PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"; \
	echo "    -d '{\"model\": \"'$$(basename $$path .gguf)'\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'"; \
	echo "OpenAI-compatible base URL (OPENAI_BASE_URL; Ollama clients: http://127.0.0.1:$(HTTP_PORT)):"; \
	KTD_MODEL__PATH="$$path" KTD_SERVER__SOCKET_GROUP=null $(PY) -m ktd serve --socket $(RUN_SOCKET) & dpid=$$!; \
	$(PY) -m ktd http --socket $(RUN_SOCKET) --listen 127.0.0.1:$(HTTP_PORT) & hpid=$$!; \
	trap 'kill -TERM $$hpid $$dpid 2>/dev/null' INT TERM; \
	wait -n $$dpid $$hpid; rc=$$?; kill -TERM $$hpid $$dpid 2>/dev/null; wait $$dpid $$hpid; exit $$rc

# In-process generation without the daemon (ktd run): the default model on a demo prompt.
# RUN_ARGS="--threads 4 --max-tokens 512" overrides.
demo: build
	$(PY) -m ktd run $(MODEL) --chat --prompt "Write a Python function that checks whether a number is prime." $(RUN_ARGS)

# The three real models of docs/MODELS.md into the cache (~/.cache/ktd/models, or $$KTD_CACHE).
fetch-models: build
	$(PY) -m ktd fetch --all

# End to end, ktd vs llama.cpp on the same files and threads, interleaved (docs/PERFORMANCE.md):
# bench/results/bench.json + bench.png. Options: make bench BENCH_ARGS="--quick --threads 2".
BENCH_ARGS ?=
bench: build oracle
	$(PY) -m ktd.bench.e2e $(BENCH_ARGS)

bench-kernels: build
	$(PY) -m ktd.bench.kernels

# Decode as % of the DRAM ceiling, each step interleaved with a bandwidth pass (medians of both):
# make bench-decode MODEL=qwen2.5-coder-1.5b BENCH_DECODE_ARGS="--threads 1 --tokens 64".
BENCH_DECODE_ARGS ?=
bench-decode: build
	$(PY) -m ktd.bench.decode $(MODEL) $(BENCH_DECODE_ARGS)

# Sampling cost per mode as a share of a qwen2.5-coder-0.5b decode step (2 threads).
bench-sampling: build
	$(PY) -m ktd.bench.sampling $(BENCH_SAMPLING_ARGS)

# Time to READY vs reading the file: cat, Python import, ktd run cold (cache off) and
# warm (prepared-weights cache), alternating, best of N: bench/results/load.json.
# Options: make bench-load BENCH_LOAD_ARGS="--reps 5 --threads 2 MODEL.gguf".
BENCH_LOAD_ARGS ?=
bench-load: build
	$(PY) -m ktd.bench.load $(BENCH_LOAD_ARGS)

# The daemon: decode through the socket vs in-process, aggregate tokens/s with 1/2/4/8 streams
# (ktctl bench), the same through the HTTP gateway (ktd-http; --no-http skips it), native forward
# with n rows: bench/results/daemon.json.
# Options: make bench-daemon BENCH_DAEMON_ARGS="--threads 4 --reps 5".
BENCH_DAEMON_ARGS ?=
bench-daemon: build
	$(PY) -m ktd.bench.daemon $(BENCH_DAEMON_ARGS)

# Benchmark-sized synthetic MoE models (DeepSeek-V2-Lite- and Qwen3-30B-A3B-shaped, Q4_K_M, a few GB
# each) into $${KTD_CACHE:-~/.cache/ktd}/synthetic; needs llama-cpp-python for the quantizer.
synthetic-moe: venv
	$(PY) -m tests.models.synthetic_moe --preset bench

# A Qwen2.5-7B-shaped dense Q4_K_M of random valid blocks (4.4 GB, about a minute; no quantizer):
# decode from DRAM where the L3 holds the small models. python -m ktd.bench.e2e --models
# synthetic-qwen2-7b-bench, or ktd.bench.decode on the file.
synthetic-dense: venv
	$(PY) -m tests.models.synthetic_dense

# The MoE bench shapes with the real models' layers and a quarter of their experts (Qwen3-30B-A3B
# 5.3 GB, DeepSeek-V2-Lite 3.2 GB; 1.9 and 1.6 GB read per token; ~15 minutes, ~18 GB of scratch
# disk): MoE decode from DRAM where the L3 holds much of the bench files. python -m ktd.bench.e2e
# --models synthetic-qwen3moe-dram synthetic-deepseek2-v2-lite-dram.
synthetic-dram: venv
	$(PY) -m tests.models.synthetic_moe --preset dram

wheel: venv
	$(PIP) wheel --no-deps --no-build-isolation -w dist .

# Debian 12 package + offline bundle in dist/ (packaging/build-deb.sh; root: apt, chroot), and its
# checks: lintian, unit verify/security, offline install/upgrade/purge in a minimal Debian 12 root
# (packaging/test-deb.sh). KTD_VERSION=X.Y.Z overrides the package version.
# ARCH=arm64: the arm64 package and bundle (aarch64 wheels, the cross-built native module,
# dpkg-buildpackage in the arm64 root of test-arm64 under qemu-user), and its test in an arm64
# Debian 12 root under emulation (install offline, serve a tiny model through the socket, purge).
ARCH ?=
deb:
	KTD_DEB_ARCH=$(ARCH) packaging/build-deb.sh

test-deb: deb
	KTD_DEB_ARCH=$(ARCH) packaging/test-deb.sh

# aarch64 without ARM hardware (root; tools/arm64/): cross-compile the native module with Debian's
# g++-aarch64-linux-gnu into build/arm64 and run the ARM-relevant tests in an arm64 Debian 12 root
# (~/.cache/ktd/arm64-root, made once by mmdebstrap --variant=extract: no package script runs under
# qemu; tools/arm64/make-root.sh) under qemu-user, with -cpu max (dotprod, i8mm) and
# -cpu cortex-a57 (no dotprod: the fallbacks). Correctness only: emulated speed means nothing.
# KTD_ARM64_TESTS / KTD_ARM64_CPUS / PYTEST_ARGS narrow or widen it.
test-arm64: venv
	@command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64-static >/dev/null && command -v mmdebstrap >/dev/null && command -v arch-test >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      g++-aarch64-linux-gnu qemu-user-static binfmt-support mmdebstrap arch-test file >/dev/null; }
	CMAKE=$(CURDIR)/$(VENV)/bin/cmake NINJA=$(CURDIR)/$(VENV)/bin/ninja KTD_HOST_PYTHON=$(CURDIR)/$(PY) \
	  PYTEST_ARGS="$(PYTEST_ARGS)" KTD_ARM64_LIST="$(KTD_ARM64_LIST)" tools/arm64/test-arm64.sh

# CI's arm64 run (.ci/run): the same with CI's shorter test lists (tools/arm64/test-arm64.sh,
# KTD_ARM64_LIST=ci: every kernel type and tier, repacks, forward passes and tokenizer/chat under
# -cpu max; features, kernels, repacks and forward passes under -cpu cortex-a57).
test-arm64-ci:
	$(MAKE) test-arm64 KTD_ARM64_LIST=ci

# On a machine with an NVIDIA GPU (driver R580+ for CUDA 13), in one short run: the native module
# and libktd_cuda.so (carried, or built with KTD_CUDA=ON for the GPU's architecture), the cuda tests
# with the gpu-marked kernels, ONE JSON (bench/results/gpu-check.json, or $$OUT/gpu-check.json)
# (tools/gpu_check/run.sh). gpu-carry (here, with PyPI) prepares the wheelhouse for a device
# without PyPI, another Python or no gguf (tools/gpu_check/carry.sh).
gpu-check:
	KTD_GPU_PYTHON=$(if $(wildcard $(PY)),$(CURDIR)/$(PY),) tools/gpu_check/run.sh

gpu-carry:
	PY=$(if $(wildcard $(PY)),$(CURDIR)/$(PY),python3) tools/gpu_check/carry.sh

clean:
	rm -rf build daemon/ktd/_native*.so daemon/ktd/libktd_cuda.so

distclean: clean
	rm -rf $(VENV)

# The fuzz and fault campaign (tests/fuzz.py): >= 100k hostile frames against the daemon,
# >= 10k mutated model files through the loader, >= 50k hostile requests and >= 1k slow or
# abandoned connections against the HTTP gateway, fixed seeds; prints the table (crashes, hangs,
# unanswered, untyped errors, 5xx, RSS before/after) and fails on any finding. CI runs a slice of
# it (tests/daemon/test_fuzz.py).
FUZZ_FRAMES ?= 100000
FUZZ_FILES ?= 10000
FUZZ_HTTP_REQUESTS ?= 50000
FUZZ_HTTP_SLOW ?= 1000
fuzz: build
	PYTHONPATH=tests $(PY) tests/fuzz.py --frames $(FUZZ_FRAMES) --files $(FUZZ_FILES) \
	  --http-requests $(FUZZ_HTTP_REQUESTS) --http-slow $(FUZZ_HTTP_SLOW)
