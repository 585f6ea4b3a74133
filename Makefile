# Two set-up-free entry points: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean cc chromium nftables lock

# Exact versions from requirements.lock (pyproject.toml holds the compatible ranges), then swarmlm itself with
# no further resolution. The lock pins torch==2.13.0, which the CPU wheel on disk satisfies (no CUDA build).
$(STAMP): pyproject.toml requirements.lock
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.lock
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

# after changing dependencies in pyproject.toml and installing them into .venv: write the lock from the venv
lock:
	$(BIN)/python .ci/lock.py > requirements.lock

demo: $(STAMP) cc
	$(BIN)/swarmlm demo

# a C compiler for the packed-weight kernels (swarmlm/kernels/packed.c, built on first use), installed once when missing
cc:
	@command -v cc >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq gcc libc6-dev >/dev/null; } \
		|| echo "could not install gcc (not root?): GGUF weights will be dequantized, int8/int4 refused"

# headless Chromium for the monitor page's browser test (Debian's package), installed once when missing
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
		|| echo "could not install chromium (not root?): tests/test_monitor_browser.py will fail"

# nftables for the NAT testbed (tests/test_nat.py: a masquerading router in a network namespace), once when missing
nftables:
	@command -v nft >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq nftables >/dev/null; } \
		|| echo "could not install nftables (not root?): tests/test_nat.py will be skipped"

test: $(STAMP) cc chromium nftables
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile --durations=15

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV)
