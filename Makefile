# qkv: the commands a new machine needs.
#   make build  install what building needs (library, tool, Python module) if missing, build
#   make demo   install what the tool needs if missing, build it, run the guided tour (qkv demo)
#   make test   install everything the tests need if missing, then build and run the suite three
#               times (optimised; ASan + UBSan; the thread stress test under TSan) and the fuzzers'
#               CI lane (FUZZ_CI_SECONDS each under ASan + UBSan)
#   make fuzz   run each fuzzer for FUZZ_SECONDS (corpora in build/fuzz/corpus, seeds in fuzz/corpus)
# Only scripts/install-deps.sh calls apt (and sudo when not root), and only for missing packages:
# on a machine that has them, no target needs root.
BUILD ?= build
JOBS ?= 2
FUZZ_SECONDS ?= 300
FUZZ_CI_SECONDS ?= 30

.PHONY: all configure build demo test test-release test-sanitize test-tsan test-fuzz fuzz fuzz-build clean

all: build

configure:
	@bash scripts/install-deps.sh tools python
	cmake -S . -B $(BUILD)/release -DCMAKE_BUILD_TYPE=Release -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCHMARKS=OFF

build: configure
	cmake --build $(BUILD)/release -j$(JOBS)

demo:
	@bash scripts/install-deps.sh tools
	cmake -S . -B $(BUILD)/release -DCMAKE_BUILD_TYPE=Release -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCHMARKS=OFF
	cmake --build $(BUILD)/release -j$(JOBS) --target qkv_cli
	$(BUILD)/release/tools/qkv/qkv demo

test: test-release test-sanitize test-tsan test-fuzz

test-release:
	@bash scripts/install-deps.sh test
	cmake -S . -B $(BUILD)/release -DCMAKE_BUILD_TYPE=Release -DQKV_BUILD_TESTS=ON -DQKV_BUILD_BENCHMARKS=ON
	cmake --build $(BUILD)/release -j$(JOBS)
	cd $(BUILD)/release && ctest --output-on-failure -j$(JOBS)

test-sanitize:
	@bash scripts/install-deps.sh test
	cmake -S . -B $(BUILD)/sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQKV_SANITIZE=ON
	cmake --build $(BUILD)/sanitize -j$(JOBS)
	cd $(BUILD)/sanitize && ctest --output-on-failure -j$(JOBS)

# ThreadSanitizer: only the library and the concurrency stress test (tests/concurrency/test_concurrency.cpp).
test-tsan:
	@bash scripts/install-deps.sh test
	cmake -S . -B $(BUILD)/tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQKV_TSAN=ON
	cmake --build $(BUILD)/tsan -j$(JOBS) --target qkv_concurrency_tests
	cd $(BUILD)/tsan && ctest --output-on-failure -L tsan

# libFuzzer (clang) with ASan + UBSan: the fuzz targets of fuzz/, in a build of their own.
fuzz-build:
	@bash scripts/install-deps.sh test
	cmake -S . -B $(BUILD)/fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DQKV_FUZZ=ON
	cmake --build $(BUILD)/fuzz -j$(JOBS)

test-fuzz: fuzz-build
	bash fuzz/run.sh $(BUILD)/fuzz $(FUZZ_CI_SECONDS)

fuzz: fuzz-build
	bash fuzz/run.sh $(BUILD)/fuzz $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD)
