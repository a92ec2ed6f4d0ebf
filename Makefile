# Task runner. The README's two commands are `make quickstart` and `make test`; each sets up what it
# needs (scripts/setup.sh), builds, then runs.
BUILD ?= build
JOBS ?= $(shell nproc)
PY := .venv/bin/python
# Where the wheel keeps TorchConfig.cmake, found without importing torch: the wheel is installed --no-deps,
# and `import torch` needs Python packages only the test setup installs (typing_extensions, ...).
TORCH_PREFIX = $(shell $(PY) -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "share", "cmake"))')

.PHONY: setup setup-test configure build build-cli quickstart test bench clean

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh --test

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$(TORCH_PREFIX)" \
	  -DKVBOUND_PYTHON=$(CURDIR)/$(PY)

configure: $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The kvbound binary alone: what the quickstart runs (no tests, fuzzers or benches).
build-cli: configure
	cmake --build $(BUILD) -j $(JOBS) --target kvbound

quickstart: setup
	$(MAKE) build-cli
	scripts/quickstart.sh $(BUILD)

test: setup-test
	$(MAKE) build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

bench: setup-test
	$(MAKE) build
	scripts/bench.sh $(BUILD)
	scripts/bench_decode.sh $(BUILD)
	scripts/bench_train.sh $(BUILD)

clean:
	rm -rf $(BUILD)
