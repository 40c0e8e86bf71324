# Two commands on a fresh machine: `make serve` and `make test`.
# torch is installed first with the exact pin from constraints.txt (a looser spec would
# pull a CUDA build with gigabytes of dependencies on a machine that has none).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast reliability fuzz lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvserve serve $(ARGS)

# System packages the tests drive for real: Debian's chromium (the chat page test) and
# Debian's prometheus/promtool, unpacked into .venv/prometheus without starting a service;
# the Prometheus Operator's CRD schemas (npm's @kubernetes-models) for the Kubernetes test;
# the official openai Node SDK for its tool-calling test.
SYSDEPS := $(VENV)/.sysdeps

$(SYSDEPS): $(STAMP)
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "warning: could not install chromium; the browser test will be skipped"
	@test -x $(VENV)/prometheus/usr/bin/promtool || ( \
		cd $(VENV) && (apt-get download prometheus >/dev/null 2>&1 || (apt-get update -qq && apt-get download prometheus >/dev/null 2>&1)) \
		&& dpkg -x prometheus_*.deb prometheus && rm -f prometheus_*.deb ) \
		|| echo "warning: could not fetch prometheus; the Prometheus tests will be skipped"
	@test -d $(VENV)/npm/node_modules/@kubernetes-models/prometheus-operator || \
		npm install --silent --no-audit --no-fund --prefix $(VENV)/npm @kubernetes-models/prometheus-operator@6.0.0 \
		|| echo "warning: could not install @kubernetes-models/prometheus-operator; the ServiceMonitor check will be skipped"
	@test -d $(VENV)/npm/node_modules/openai || \
		npm install --silent --no-audit --no-fund --prefix $(VENV)/npm openai@7.59.0 \
		|| echo "warning: could not install the openai Node SDK; its test will be skipped"
	touch $(SYSDEPS)

test: $(STAMP) $(SYSDEPS)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The reliability scenarios alone, rewriting their table in tests/RELIABILITY.md
# (KVSERVE_SOAK_SECONDS=600 for a longer soak).
reliability: $(STAMP) $(SYSDEPS)
	KVSERVE_RELIABILITY_REPORT=tests/RELIABILITY.md $(PY) -m pytest -q tests/reliability $(PYTEST_ARGS)

# the API fuzz scenario with new random draws (CI runs a fixed set); repeat to explore
fuzz: $(STAMP)
	KVSERVE_FUZZ=random $(PY) -m pytest -q tests/reliability/test_fuzz.py $(PYTEST_ARGS)

# without the parity runs against transformers and the reliability scenarios, and the
# kernel tests at this CPU's own ISA level, each once (make test runs the whole matrix)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not reliability" --kernel-matrix native $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
