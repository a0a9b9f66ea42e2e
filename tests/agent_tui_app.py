"""The agent TUI on the scripted model, for tests/test_agent_tui.py (run in tmux).

usage: python tests/agent_tui_app.py PROJECT_DIR SESSIONS_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
from agent_helpers import dsml, last_real_user, make_worker, steps  # noqa: E402

from ds4mlx.agent.tui import run_tui  # noqa: E402
from ds4mlx.runtime.tokenizer import Tokenizer  # noqa: E402


def script(prompt: str):
    user = last_real_user(prompt)
    if "slow" in user:
        return steps(dsml("bash", command="sleep 60"), "unreachable")(prompt)
    if "write hello" in user:
        return steps(dsml("write", path="hello.txt", content="hello from the agent\n"), "Wrote **hello.txt**.")(prompt)
    if "read it back" in user:
        return steps(dsml("read", path="hello.txt"), "It says: hello from the agent.")(prompt)
    return "Hello **there**, the project has `a.txt`."


def main() -> int:
    tok = Tokenizer.default()
    model, engine, worker, _ = make_worker(tok, script, sys.argv[1], trusted=False, timeout=60.0)
    try:
        return run_tui(worker, SimpleNamespace(sessions_dir=sys.argv[2]))
    finally:
        worker.close()
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
