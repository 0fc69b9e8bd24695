# Two entry points on a fresh machine: `make demo` and `make test`.
# Both build the project virtualenv from pyproject.toml, pinned by constraints.txt
# (torch 2.13.0 CPU is the tested build; an unpinned torch would pull CUDA wheels).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Azurite (the Azure Storage emulator the tests start on 127.0.0.1) from npm, in the work tree.
AZURITE_VERSION := 3.37.0
AZURITE := .tools/azurite/node_modules/.bin/azurite-blob

.PHONY: install demo test soak lint bench docs clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,s3,gcs,azure,hf,lightning,text]"
	touch $(STAMP)

$(AZURITE):
	npm install --no-audit --no-fund --silent --prefix .tools/azurite azurite@$(AZURITE_VERSION)

install: $(STAMP) $(AZURITE)

demo: $(STAMP)
	$(PY) examples/demo.py

# The coverage floor only rises (97 % measured when it was set). Two processes (pytest-xdist), a
# test file each at a time: its module fixtures (torchrun launches, datasets) built once; the
# DataLoader workers' coverage is combined as in one process.
test: $(STAMP) $(AZURITE)
	$(PY) -m pytest -n 2 --dist loadfile --cov --cov-fail-under=95

# Crash soak: 100 SIGKILLs of a 2-worker training subprocess (whole group, mid-checkpoint, one
# worker, the trainer alone), each resumed from its last checkpoint; every row once per epoch.
# A few minutes; `tests/test_soak.py` runs an 8-kill version under `make test`. Then the model-based
# lifecycle test (tests/test_lifecycle.py) at 200 sequences of 30 steps (6 of 14 under `make test`),
# and the mixture's (tests/test_mixture_lifecycle.py) at 200 of 30 (12 of 15 under `make test`).
soak: $(STAMP)
	$(PY) tests/_soak.py --cycles 100
	TDU_LIFECYCLE_EXAMPLES=200 TDU_LIFECYCLE_STEPS=30 $(PY) -m pytest -q tests/test_lifecycle.py
	TDU_MIXLIFE_EXAMPLES=200 TDU_MIXLIFE_STEPS=30 $(PY) -m pytest -q tests/test_mixture_lifecycle.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check torch_dataloader_utils tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,s3,hf,lightning,bench,text]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_throughput.py --plot bench_output/throughput.png
	$(PY) benchmarks/bench_resume.py --plot bench_output/resume.png
	$(PY) benchmarks/bench_s3.py --plot bench_output/s3.png
	$(PY) benchmarks/bench_index_cache.py --plot bench_output/index_cache.png
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_shuffle.py --plot bench_output/shuffle.png
	$(PY) benchmarks/bench_tokens.py --plot bench_output/tokens.png
	$(PY) benchmarks/bench_mixing.py --json bench_output/mixing.json
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_stall.py --plot bench_output/stall.png
	$(PY) benchmarks/bench_stats.py --json bench_output/stats.json
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_text.py --json bench_output/text.json
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_chat.py --json bench_output/chat.json
	$(PY) benchmarks/bench_packing_waste.py
	$(PY) benchmarks/bench_mixture_quality.py
	# last: it exits 1 while a mixture's peak memory is over its bound (issue 32)
	$(PY) benchmarks/bench_mixture_scale.py --json bench_output/mixture_scale.json

DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,s3,hf,lightning,docs]"
	touch $(DOCS_STAMP)

# The site (mkdocs-material; API reference from docstrings by mkdocstrings) into site/.
# Strict: any warning (a broken link, a docstring that does not render) fails the build.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .tools demo_output bench_output site .pytest_cache .mypy_cache .hypothesis
