# Two entry points for a fresh machine (Python >= 3.10 with venv):
#   make run    set up .venv and run the quickstart (SmolLM2, needle-in-a-haystack, 3 methods)
#   make test   set up .venv and run the test suite
# and for development:
#   make lint   ruff (style and bug patterns, [tool.ruff]), `ruff format --check` (layout) and mypy (types,
#               [tool.mypy]); not part of `make test`
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.kvbench-installed
STAMP := $(VENV)/.kvbench-test-installed
RUN_ARGS ?= -m method=full,oracle,streamingllm budget.token_ratio=0.1 'task.lengths=[1024,2048]' 'task.depths=[0,0.5,1]'

.PHONY: install run test lint clean

# what running needs (torch first, pinned, then kvbench and its dependencies): make run's set-up. No
# byte-compiling at install (--no-compile): Python compiles the modules a run imports when it first imports
# them, instead of every file of every package up front (half of the set-up's time)
$(BASE): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q --no-compile --disable-pip-version-check -c constraints.txt -e .
	touch $(BASE)

# and the test extra (pytest, faiss, scikit-learn, the launchers, ruff, mypy): make test and make lint
$(STAMP): $(BASE)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

run: $(BASE)
	$(BIN)/kvbench run $(RUN_ARGS)

# two pytest-xdist workers by default (CI has 2 cores; one intra-op thread each, tests/conftest.py);
# TEST_WORKERS=0 runs the suite in this process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# mypy runs through tools/typecheck.py, which maps methods/ and tasks/ to kvbench.methods and kvbench.tasks
lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/python tools/typecheck.py

clean:
	rm -rf $(VENV) build *.egg-info results/runs .ruff_cache .mypy_cache
