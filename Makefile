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
                  tests/test_model.py tests/test_budget.py

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
test: export HF_HUB_OFFLINE = 1
test: install
	@# The browser test needs Debian's chromium (never `playwright install`); a missing browser fails that test.
	@test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	$(PY) -m pytest -q
	@# The numerics-sensitive tests again on AVX2 kernels: ATen and oneDNN pick kernels by instruction set, so
	@# two kernel paths agree to float32 rounding, not bit for bit (docs/DESIGN.md, "Numerics"); ~75 s.
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q -p no:cacheprovider $(NUMERICS_TESTS)

run: install
	@# The app turns the hub off itself for a local model (the default, embedded one); a hub id given
	@# with ARGS="--model ..." downloads as usual, and a user's own HF_HUB_OFFLINE is respected.
	$(PY) app.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
