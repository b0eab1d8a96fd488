# k3: `make demo` and `make test` work from nothing; `.venv` is made here with torch==2.13.0 first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.k3-installed
TORCH  := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup bwrap test demo bench bench-long lint clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@$(BIN)/python -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '2.13.0' else 'torch ' + torch.__version__ + ' was installed, expected 2.13.0')"
	@touch $(STAMP)

setup: $(STAMP) bwrap

# AgentENV sandboxes run on bubblewrap (Debian package); install it when missing and we are root.
bwrap:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap python3 >/dev/null; }; } || \
	  { echo "k3 agentenv needs bubblewrap: run 'sudo apt-get install -y bubblewrap' (Debian/Ubuntu)" >&2; exit 1; }

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/k3 demo

bench: setup
	$(BIN)/python benchmarks/peaks.py --json
	$(BIN)/python benchmarks/kda.py --json
	$(BIN)/python benchmarks/moe.py --json
	$(BIN)/python benchmarks/mx.py --json
	$(BIN)/python benchmarks/balancing.py --json
	$(BIN)/python benchmarks/sandbox.py --json
	$(BIN)/python benchmarks/train.py --json
	$(BIN)/python benchmarks/ep.py --json
	$(BIN)/python benchmarks/serve_load.py --json
	$(BIN)/python benchmarks/decode.py --json
	$(BIN)/python benchmarks/report.py

# hours on 2 CPU cores: QAT training runs (about 40 min) and a 1,048,576-token prefill (about 2 h)
bench-long: setup
	$(BIN)/python benchmarks/qat.py --json
	$(BIN)/python benchmarks/long_context.py --json
	$(BIN)/python benchmarks/report.py

lint: setup
	$(BIN)/python -m compileall -q src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
