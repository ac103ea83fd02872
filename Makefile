# The README's two commands: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2-135m-instruct
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install serve test lint bench gpu-check clean

install: $(STAMP)

# Torch first, pinned to the CPU build when there is no CUDA, so that no
# dependency pulls a multi-GB CUDA wheel; then the project, editable, with dev extras.
$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q 'torch>=2.4,<2.15'; \
	else \
	  $(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch==2.13.0; \
	fi
	# The rest through uv when it installs (parallel, ~3x faster than pip here), else pip.
	# uv keeps the torch just installed: 2.13.0 satisfies the project's range. uv writes no
	# bytecode at install (pip does); Python writes it at first import, which `make test`
	# lets it do even where PYTHONDONTWRITEBYTECODE is set (below).
	if $(PY) -m pip install -q 'uv>=0.5,<1' && $(VENV)/bin/uv --version >/dev/null 2>&1; then \
	  $(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev]' && \
	  $(VENV)/bin/uv pip install -q --python $(PY) --no-deps 'instructor>=1.17,<2'; \
	else \
	  $(PY) -m pip install -q -e '.[dev]' && \
	  $(PY) -m pip install -q --no-deps 'instructor>=1.17,<2'; \
	fi
	# (instructor, for the tool-call tests, pins jiter<0.15, which openai>=3.4 outgrew;
	# without its deps it runs on the newer jiter: its other deps are in the dev extras.)
	touch $(STAMP)

serve: install
	$(VENV)/bin/trillm serve --model $(MODEL) --host $(HOST) --port $(PORT)

# One pytest worker per core (pytest-xdist); each takes half the tests (the files with slow
# ones first, conftest.py) and an idle one takes half of what the other has left, so the run
# ends together; `make test PYTEST_ARGS=` runs them in one process.
# Bytecode caches on for the run (PYTHONDONTWRITEBYTECODE cleared): each worker and each server
# it starts imports the project, its dependencies and the tests, and would otherwise compile
# them from source every time (transformers alone: seconds per process).
PYTEST_ARGS ?= -n auto --dist worksteal
test: install lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(PYTEST_ARGS)

# ruff (lint, import order, format) and mypy over the package. mypy reads the
# installed names (trillm.api, ...) from a tree of links, since the folders
# themselves are named api/, engine/, ...
TYPECHECK := build/typecheck
# mypy's incremental cache, outside the checkout so that a fresh clone reuses it (its paths are
# relative to the tree of links; mypy checks every module's hash): 78 s cold, 4 s warm here.
MYPY_CACHE ?= $(HOME)/.cache/trillm/mypy
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	rm -rf $(TYPECHECK)/trillm && mkdir -p $(TYPECHECK)/trillm
	for d in api bench engine kernels; do ln -s ../../../$$d $(TYPECHECK)/trillm/$$d; done
	ln -s ../../../engine/offline/toplevel/__init__.py $(TYPECHECK)/trillm/__init__.py  # `from trillm import LLM`
	cd $(TYPECHECK) && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml --cache-dir $(MYPY_CACHE) \
	  -p trillm.api -p trillm.bench -p trillm.engine -p trillm.kernels -m trillm

bench: install
	$(VENV)/bin/trillm bench --model $(MODEL)

# On a CUDA machine: the Triton kernels compiled (not interpreted) against their
# references, then a Llama-3-8B-shaped model with random weights through the server
# (and split over two GPUs where there are two).
gpu-check: install
	$(PY) -m pytest -q -m gpu
	$(VENV)/bin/trillm bench --load-format dummy --model engine/configs/llama-3-8b.json --concurrency 1,16,64
	# With two GPUs or more: the same model at --tp 2 (NCCL) beside --tp 1.
	if [ "$$(nvidia-smi -L | wc -l)" -ge 2 ]; then \
	  $(VENV)/bin/trillm bench --load-format dummy --model engine/configs/llama-3-8b.json \
	    --concurrency 1,16,64 --tp 1,2 --no-baseline; \
	fi

clean:
	rm -rf $(VENV) build *.egg-info
