# shardstream: `make demo` and `make test` are all a newcomer needs.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
# One build profile for `cargo test` and maturin, so dependencies compile once.
CARGO_PROFILE := --release

.PHONY: help venv develop wheel wheel-aarch64 test-aarch64 sdist demo test test-fast test-rust test-python fuzz lint lint-rust lint-python lint-stubtest fmt bench bench-micro bench-peers peers-wheel bench-peers-s3 bench-train bench-gpu clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): requirements-dev.txt
	@build-support/nasm
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	@touch $@

venv: $(STAMP) ## Create or refresh the virtualenv (.venv)

develop: $(STAMP) ## Build the extension into .venv (editable)
	maturin develop $(CARGO_PROFILE) --quiet

# The wheel is built from the release build `make develop` and `make test`
# already made (cargo finds nothing to compile); the profile has no debug
# info, so there is nothing to strip. One abi3 wheel serves every CPython
# from 3.10 on. The extension is linked against glibc 2.28's symbols (zig,
# from the ziglang package: build-support/linker), and maturin checks that
# the wheel keeps to manylinux_2_28 before tagging it so.
WHEEL_PLATFORM := manylinux_2_28

wheel: $(STAMP) ## Build the x86-64 Linux wheel (dist/shardstream-*.whl) for `pip install`
	rm -f dist/shardstream-*x86_64.whl
	maturin build $(CARGO_PROFILE) --compatibility $(WHEEL_PLATFORM) -i $(PY) --out dist
	@ls dist/shardstream-*x86_64.whl

# The aarch64 wheel (GH200/GB200, Graviton) is cross-compiled with zig as
# linker and C compiler: a second compile of everything, into
# target/aarch64-unknown-linux-gnu, so it is not part of `make test`.
AARCH64 := aarch64-unknown-linux-gnu
AARCH64_BUILD := build/wheel-aarch64

wheel-aarch64: $(STAMP) ## Cross-build the aarch64 Linux wheel (dist/) with zig: a second full compile
	@rustup target list --installed 2>/dev/null | grep -qx $(AARCH64) || { \
		echo "error: the Rust target $(AARCH64) is not installed: run 'rustup target add $(AARCH64)'" >&2; exit 1; }
	rm -rf $(AARCH64_BUILD) dist/shardstream-*aarch64.whl
	maturin build $(CARGO_PROFILE) --zig --strip --target $(AARCH64) --compatibility $(WHEEL_PLATFORM) \
		--out $(AARCH64_BUILD)
	mkdir -p dist
	cp $(AARCH64_BUILD)/shardstream-*aarch64.whl dist/
	@ls dist/shardstream-*aarch64.whl

# An arm64 Debian root (debootstrap, unconfigured: no second stage, which
# would need binfmt_misc) in build/aarch64-root, where qemu-user-static runs
# its Python: the wheel installs into a venv there, and its CLI and
# StreamingDataset read a small dataset. Needs root for chroot.
test-aarch64: wheel-aarch64 ## Install the aarch64 wheel in an arm64 Debian root under qemu and read a dataset there
	build-support/test-aarch64

# The source distribution: pip builds it where no wheel fits (with Rust).
sdist: $(STAMP) ## Build the source distribution (dist/shardstream-*.tar.gz)
	rm -f dist/shardstream-*.tar.gz
	maturin sdist --out dist
	@ls dist/shardstream-*.tar.gz

demo: develop ## Make a small audio dataset and stream it through a DataLoader
	$(PY) examples/demo.py data/demo

# Python tests first: test_wheel.py packs `make develop`'s build as it is.
# `cargo test` links the extension's code into test programs with libpython,
# so its pyo3, numpy and crate builds differ from maturin's (no libpython).
test: develop test-python test-rust ## Install everything and run every Rust and Python test

# The `python` feature too, so dependencies resolve to the same features as
# maturin's build and are not compiled twice. Every Rust test is in the
# library's test program (src/end_to_end/ holds the tests on real files),
# so `--lib` compiles the crate once: no second build as a library for
# integration tests, the binary or doc tests.
test-rust: $(STAMP) ## Run the Rust tests
	cargo test $(CARGO_PROFILE) --features python --lib

# The Python tests run in PYTEST_WORKERS processes (pytest-xdist), each
# test handed to the first idle one: most tests wait on servers, launched
# jobs and worker processes, so four keep two cores busy.
PYTEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist worksteal

test-python: develop ## Run the Python tests
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

# The edit loop: the Rust unit tests and the Python tests not marked `slow`
# (no launched jobs, frameworks, wheels or store servers; tests/python/conftest.py).
test-fast: develop ## Run the fast tests only: Rust unit tests and the Python tests not marked slow
	cargo test $(CARGO_PROFILE) --features python --lib
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

# The mutation fuzz test of `make test` (tests/python/test_fuzz.py) with
# many more cases and a new seed each run; FUZZ_SEED=n replays a run.
FUZZ_CASES ?= 20000
FUZZ_SEED ?= $(shell date +%s)

fuzz: develop ## Mutation-fuzz the tar, gzip, zstd and Parquet readers (FUZZ_CASES, FUZZ_SEED)
	SHARDSTREAM_FUZZ_CASES=$(FUZZ_CASES) SHARDSTREAM_FUZZ_SEED=$(FUZZ_SEED) \
		$(PY) -m pytest -q tests/python/test_fuzz.py

# `make -j3 lint` (as .ci/run runs it) runs the Rust linters, mypy and
# stubtest side by side: mypy and stubtest each keep one core busy for half
# a minute while clippy's crate check leaves one idle (stubtest writes no
# mypy cache, so the two do not share one).
lint: lint-rust lint-python lint-stubtest ## rustfmt, clippy, rustdoc's links, ruff, mypy and stubtest

lint-rust: $(STAMP)
	cargo fmt --check
	cargo clippy $(CARGO_PROFILE) --all-targets --features python -- -D warnings
	RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
		cargo doc $(CARGO_PROFILE) --features python --no-deps --document-private-items --quiet

lint-python: $(STAMP)
	ruff check python tests examples benches build-support
	ruff format --check python tests examples benches build-support
	$(PY) -m mypy python/shardstream

lint-stubtest: $(STAMP)
	$(PY) -m mypy.stubtest shardstream._core

fmt: $(STAMP) ## Format Rust and Python code
	cargo fmt
	ruff format python tests examples benches build-support
	ruff check --fix python tests examples benches build-support

BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install --quiet -r requirements-bench.txt
	@touch $@

bench: develop $(BENCH_STAMP) ## Measure local, S3 and HTTP reading, field decoding, image and audio augmentation, tokenizing text (samples/s, MB/s, CPU, peak RSS) against peers, what packing across ranks leaves out, the ledger's cost and the epoch boundary's stall
	$(PY) benches/loader_bench.py --out bench-results
	$(PY) benches/s3_bench.py --out bench-results
	$(PY) benches/http_bench.py --out bench-results
	$(PY) benches/decode_bench.py --out bench-results
	$(PY) benches/augment_bench.py --out bench-results
	$(PY) benches/audio_bench.py --out bench-results
	$(PY) benches/text_bench.py --out bench-results
	$(PY) benches/tokenizer_bench.py --out bench-results
	$(PY) benches/pack_remainder.py --out bench-results
	$(PY) benches/ledger_bench.py --out bench-results
	$(PY) benches/epoch_boundary_bench.py --out bench-results

bench-startup: develop ## Start-up of one resolution per job at 1,000,000 shards: broadcast form size, ranks receiving it, worker memory, plan time
	$(PY) benches/startup_bench.py --out bench-results

# `cargo bench` builds with the bench profile, which inherits the release
# profile, and the `python` feature keeps dependency features as in
# `make test`, so its dependencies are reused (pyo3, numpy and the crate
# itself are rebuilt after `maturin develop`).
bench-micro: $(STAMP) ## Criterion micro benchmarks: tar parsing, shuffle, plan, collate, decoders, Python hand-off, local reads mapped against pread
	cargo bench --features python --bench micro -- --warm-up-time 1 --measurement-time 3

# The peers get virtualenvs of their own, so their pins never touch .venv:
# .venv-peers (webdataset, LitData, HF datasets, and shardstream as a wheel
# that maturin builds from the release profile `make develop` already built)
# and .venv-peers-mds (MosaicML Streaming, whose pins conflict with the others).
PEERS_VENV := .venv-peers
PEERS_MDS_VENV := .venv-peers-mds
PEERS_STAMP := $(PEERS_VENV)/.installed
PEERS_MDS_STAMP := $(PEERS_MDS_VENV)/.installed
PEERS_WHEELS := build/peers-wheels

$(PEERS_STAMP): benches/peers/requirements-peers.txt
	@test -x $(PEERS_VENV)/bin/python || python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet -r benches/peers/requirements-peers.txt
	@touch $@

$(PEERS_MDS_STAMP): benches/peers/requirements-mds.txt
	@test -x $(PEERS_MDS_VENV)/bin/python || python3 -m venv $(PEERS_MDS_VENV)
	$(PEERS_MDS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_MDS_VENV)/bin/python -m pip install --quiet -r benches/peers/requirements-mds.txt
	@touch $@

peers-wheel: $(STAMP) $(PEERS_STAMP) $(PEERS_MDS_STAMP)
	rm -f $(PEERS_WHEELS)/shardstream-*.whl
	maturin build --release --quiet -i $(PY) --out $(PEERS_WHEELS)
	$(PEERS_VENV)/bin/python -m pip install --quiet --force-reinstall --no-deps $(PEERS_WHEELS)/shardstream-*.whl

bench-peers: peers-wheel ## Side-by-side epoch benchmark against webdataset, LitData, MosaicML Streaming and HF datasets
	$(PEERS_VENV)/bin/python benches/peers/peers_bench.py --out bench-results \
		--mds-python $(PEERS_MDS_VENV)/bin/python $(PEERS_ARGS)

# The S3 mode reads from a local S3 server built here (s3s-fs 0.14.1 with its
# read size, TCP_NODELAY and ETag defects fixed; benches/peers/s3server), first
# directly, then behind its latency proxy (20 ms to first byte, 100 MB/s per
# connection) with the audio profile.
S3_SERVER := build/s3server-target/release/shardstream-bench-s3
S3_SERVER_SOURCES := $(wildcard benches/peers/s3server/src/*.rs) benches/peers/s3server/Cargo.toml benches/peers/s3server/Cargo.lock

$(S3_SERVER): $(S3_SERVER_SOURCES)
	cargo build --release --locked --manifest-path benches/peers/s3server/Cargo.toml \
		--target-dir build/s3server-target
	@touch $@

bench-peers-s3: peers-wheel $(S3_SERVER) ## The side-by-side benchmark reading from a local S3 server, direct and behind a latency proxy
	$(PEERS_VENV)/bin/python benches/peers/peers_bench.py --out bench-results --storage s3 \
		--mds-python $(PEERS_MDS_VENV)/bin/python $(PEERS_ARGS)
	$(PEERS_VENV)/bin/python benches/peers/peers_bench.py --out bench-results --storage s3 \
		--first-byte-ms 20 --mbps 100 --profiles audio --mds-python $(PEERS_MDS_VENV)/bin/python $(PEERS_ARGS)

# Needs a CUDA device (it refuses to run without one); the peers' virtualenv
# has webdataset, LitData and torchvision. TRAIN_ARGS: e.g. --models resnet18.
bench-train: peers-wheel ## ResNet-18/50 training (bf16) fed by shardstream's Rust transforms and by PIL in workers with each library, against the GPU's ceiling
	$(PEERS_VENV)/bin/python benches/train_bench.py --out bench-results $(TRAIN_ARGS)

# On a machine with a CUDA device: bench-train's table and the S3 benchmark
# behind the latency proxy at 0, 4, 8 and 16 workers, in one run.
bench-gpu: peers-wheel $(S3_SERVER) ## The GPU figures of docs/performance.md in one run (training, GPU decode, S3 at 0-16 workers)
	PYTHON=$(PEERS_VENV)/bin/python benches/gpu_figures.sh bench-results

clean: ## Remove build outputs, the virtualenv and generated data
	rm -rf target $(VENV) $(PEERS_VENV) $(PEERS_MDS_VENV) build dist data bench-results python/shardstream/*.so
