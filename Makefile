# Plain entry points; the README's two commands are the supported ones.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: install test test-slow test-gpu test-fuzz test-clients bench lint serve

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install -q -e ".[cpu,test]"

# README's tiers: `test` is CI's first job (.ci/run: the fast tier, then the timing-sensitive
# tests alone), `test-slow` its second (.ci/run-slow: kernel builds, the wheel, the largest cases)
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not serial and not gpu and not clients"
	$(BIN)/python -m pytest -q -m "serial and not gpu and not clients"

test-slow: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "slow and not serial and not gpu and not clients"

# Claude Code, Codex and pi (installed from npm when missing) each complete a tool loop
# against the demo server through tools/client_proxy.py (tests/test_real_clients.py).
test-clients: install
	$(BIN)/pip install -q -e ".[clients]"
	command -v claude >/dev/null && command -v codex >/dev/null && command -v pi >/dev/null || \
		npm install -g @anthropic-ai/claude-code @openai/codex @mariozechner/pi-coding-agent
	$(BIN)/python -m pytest -q -s -m clients tests/test_real_clients.py

# the full request fuzz: 2,500 bodies per generation route, 10,000 in all (CI runs 250 per route)
test-fuzz: install
	DS4MLX_FUZZ_EXAMPLES=2500 $(BIN)/python -m pytest -q tests/test_server_fuzz.py

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
