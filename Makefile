# qkv: the two commands a new machine needs.
#   make demo   install what is missing, build, run the guided tour (qkv demo)
#   make test   install what is missing, build twice (optimised; ASan + UBSan), run the suite on both
BUILD ?= build
JOBS ?= 2

.PHONY: all deps configure build demo test test-release test-sanitize clean

all: build

deps:
	@bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD)/release -DCMAKE_BUILD_TYPE=Release

build: configure
	cmake --build $(BUILD)/release -j$(JOBS)

demo: configure
	cmake --build $(BUILD)/release -j$(JOBS) --target qkv_cli
	$(BUILD)/release/tools/qkv/qkv demo

test: test-release test-sanitize

test-release: build
	cd $(BUILD)/release && ctest --output-on-failure -j$(JOBS)

test-sanitize: deps
	cmake -S . -B $(BUILD)/sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQKV_SANITIZE=ON
	cmake --build $(BUILD)/sanitize -j$(JOBS)
	cd $(BUILD)/sanitize && ctest --output-on-failure -j$(JOBS)

clean:
	rm -rf $(BUILD)
