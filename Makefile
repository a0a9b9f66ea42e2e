# Plain entry points; the README's two commands are the supported ones.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: install test test-gpu bench lint serve

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install -q -e ".[cpu,test]"

test: install
	$(BIN)/python -m pytest -q

test-gpu:
	$(PY) -m pytest -q -m gpu tests

bench: install
	$(BIN)/ds4mlx bench --ctx-start 64 --ctx-max 256 --step-mul 2 --gen-tokens 8 --csv out/bench.csv

lint: install
	$(BIN)/python -m compileall -q ds4mlx tests

serve: install
	$(BIN)/ds4mlx serve
