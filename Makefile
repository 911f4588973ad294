# The README's two commands: `make bench` (main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# PyTorch's default OpenMP busy-waiting collapses 2-thread runs under any other load.
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install bench test test-fast demo clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned and installed first so pip takes the local CPU wheel, never a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,train,bench,demo]"
	# The z-lab DFlash package, only as a peer for the format tests; its pinned dependencies
	# (an older transformers among them) are not needed for loading and dflash_generate.
	$(BIN)/pip install --quiet --no-deps dflash==0.1.0
	# Debian's chromium renders the Space in its browser test; installed when missing and root.
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
		echo "note: Debian chromium could not be installed; the Space's browser test will be skipped"
	touch $(STAMP)

bench: $(STAMP)
	$(BIN)/angelspec-hf bench

# The tests run one torch thread each (tests/conftest.py), so one pytest worker per core
# (pytest-xdist) keeps every core busy; worksteal evens out the long sampling and reference tests.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n logical --dist worksteal

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n logical --dist worksteal -m "not slow"

demo: $(STAMP)
	GRADIO_ANALYTICS_ENABLED=False $(BIN)/python spaces/app.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
