# One set of commands for humans and CI.
VENV := .venv
PY := $(VENV)/bin/python
ROLLWAY := $(VENV)/bin/rollway

.PHONY: setup run smoke test lint format demo bench docs clean

$(VENV)/.ready: pyproject.toml scripts/setup.sh scripts/setup-vllm.sh scripts/setup-agents.sh
	bash scripts/setup.sh

setup: $(VENV)/.ready

run: $(VENV)/.ready            ## a short learning run (4 groups x 8 episodes, 2 updates) on SmolLM2-135M
	$(ROLLWAY) up examples/learn.yaml scheduler.num_tasks=4

smoke: $(VENV)/.ready          ## the smoke job: 8 scripted episodes through the whole pipeline
	$(ROLLWAY) up examples/smoke.yaml

TEST_WORKERS ?= 4
# PYTHONDONTWRITEBYTECODE= : the suite starts about a thousand Python processes; where the environment sets that
# variable (some images do) each one compiled rollway's modules again and every worker rewrote each test module.
test: $(VENV)/.ready           ## the whole test suite, TEST_WORKERS tests side by side (most of its time is waiting)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=25 tests

bench: $(VENV)/.ready          ## pipelined vs bounded-batch rollout on the simulated workload (about 6 minutes)
	$(ROLLWAY) bench pipeline

docs: $(VENV)/.ready          ## the documentation site in site/ (fails on a stale config reference or a broken link)
	$(ROLLWAY) docs config --check
	$(ROLLWAY) docs topology --check
	$(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(VENV)/.ready
	$(VENV)/bin/ruff check .

format: $(VENV)/.ready
	$(VENV)/bin/ruff format .

clean:
	rm -rf runs .pytest_cache site
