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

# The tree is formatted once, after the branches of issue #15 merge (until then the
# format check fails).
lint: install
	$(BIN)/ruff check ds4mlx tests
	$(BIN)/ruff format --check ds4mlx tests

serve: install
	$(BIN)/ds4mlx serve
