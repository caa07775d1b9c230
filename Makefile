# OpenForge: `make demo` runs the main job on the embedded default; `make test` runs lint, types and the tests.
SHELL := /bin/bash
PY := .venv/bin/python
FORGE := .venv/bin/forge
PYTEST_ARGS ?=

.PHONY: env system model harnesses test lint typecheck unit demo clean-runs

# The three environments (main, sidecar, policy server), built once from requirements/*.txt and reused.
env:
	@scripts/env.sh main
	@scripts/env.sh sidecar
	@scripts/env.sh policy

# SmolLM2-135M-Instruct as bf16 (serving) and fp32 (training) checkpoints; idempotent.
model: env
	@HF_HUB_OFFLINE=1 $(FORGE) model prepare

# Debian packages the tests use (iptables, chromium), installed when missing.
system:
	@scripts/system.sh

# The real harnesses the end-to-end tests drive (pinned; installed once from npm into $FORGE_CACHE).
harnesses:
	@scripts/harness.sh codex >/dev/null
	@scripts/harness.sh claude-code >/dev/null
	@scripts/harness.sh mini-swe-agent >/dev/null
	@scripts/harness.sh qwen-code >/dev/null
	@scripts/harness.sh pi >/dev/null
	@scripts/harness.sh ai-sdk >/dev/null
	@scripts/harness.sh openai-agents >/dev/null

lint: env
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck: env
	$(PY) -m mypy

# Everything: lint, types, unit and integration tests (the integration tests start real vLLM servers).
# pytest's exit 5 (nothing collected) is a failure here, said in words.
test: lint typecheck model harnesses system
	@HF_HUB_OFFLINE=1 $(PY) -m pytest --durations=15 $(PYTEST_ARGS); code=$$?; \
	  if [ $$code = 5 ]; then echo "make test: pytest collected no tests: that is a failure"; fi; exit $$code

# Only the fast tests.
unit: env
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

# The whole loop on the embedded default (forge demo --help: --tasks, --rollouts, --rounds, --store, ...).
DEMO_ARGS ?=
demo: model
	@scripts/harness.sh mini-swe-agent >/dev/null
	@scripts/harness.sh qwen-code >/dev/null
	@scripts/harness.sh pi >/dev/null
	@HF_HUB_OFFLINE=1 $(FORGE) demo $(DEMO_ARGS)
