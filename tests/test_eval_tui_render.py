"""The TUI's drawing, captured through rich (no terminal): double-width text in the
live output, the speed figure while paused, the status line while the cursor is on
another case, the endpoint's think cap."""

from __future__ import annotations

import io
import time

from rich.cells import cell_len
from rich.console import Console

from ds4mlx.eval import load_cases
from ds4mlx.eval.backends import FakeBackend
from ds4mlx.eval.runner import Options, Runner
from ds4mlx.eval.tui import TUI, fit_cells

CORE = load_cases("core")
COLS, ROWS = 120, 30


def _screen(tui: TUI) -> list[str]:
    console = Console(file=io.StringIO(), width=COLS, height=ROWS, record=True, color_system=None, legacy_windows=False)
    tui.console = console
    console.print(tui.render())
    return console.export_text().splitlines()


def _runner(**opts) -> Runner:
    runner = Runner(CORE[:3], FakeBackend(), Options(tokens=64, **opts))
    runner.size_context()
    return runner


def _right(lines: list[str]) -> list[str]:
    return [line.split(" | ", 1)[1] if " | " in line else "" for line in lines]


def test_double_width_output_loses_no_character():
    text = "".join(chr(0x4E00 + i) for i in range(150)) + "。答えはB"
    head, rest = fit_cells(text, 5)
    assert head == text[:2] and rest == text[2:]  # 2 + 2 cells; a third would make 6
    runner = _runner()
    cr = runner.runs[0]
    cr.status, cr.raw, runner.active = "RUNNING", [text[:70], text[70:]], 0
    tui = TUI(runner)
    right = _right(_screen(tui))
    tail = right[5:]  # status, three question lines, a blank line, then the output
    shown = "".join(x.rstrip() for x in tail)
    assert text in shown
    for line in _screen(tui):
        assert cell_len(line) <= COLS


def test_speed_excludes_paused_time_and_cursor_keeps_the_running_case():
    runner = _runner()
    tui = TUI(runner)
    cr = runner.runs[0]
    cr.status, runner.active = "RUNNING", 0
    cr.raw, cr.generated = ["w "] * 20, 20
    cr.phase_tokens = 20
    now = time.monotonic()
    cr.t_phase = now - 10.0  # 10 s since the phase began ...
    cr.phase_paused0 = 0.0
    runner.control.paused_seconds = 8.0  # ... of which 8 s paused: 20 tokens in 2 s
    status = _right(_screen(tui))[0]
    assert status.startswith(("Speed 10.0 t/s", "Speed 9.9 t/s")), status
    # paused now: the open pause does not count either
    runner.control.paused_seconds = 0.0
    runner.control.toggle_pause()
    runner.control.pause_started = now - 8.0
    status = _right(_screen(tui))[0]
    assert status.startswith(("Speed 10.0 t/s", "Speed 9.9 t/s")), status
    runner.control.toggle_pause()
    # the cursor on a pending case: the status line still shows the running case
    tui.handle("down")
    tui.handle("down")
    tui.handle("down")  # cursor on case 3
    lines = _screen(tui)
    right = _right(lines)
    assert "RUN 0/" not in "\n".join(right)
    assert f"{CORE[0]['source']}/{CORE[0]['id'][:12]}" in right[0]  # the running case
    assert any(f"viewing 3 PEND {CORE[2]['source']}/{CORE[2]['id']}" in x for x in right)


def test_endpoint_without_continuation_shows_no_think_cap():
    from ds4mlx.eval.backends import EndpointBackend

    runner = Runner(CORE[:1], EndpointBackend("http://127.0.0.1:9", model="m"), Options(tokens=64))
    runner.size_context()
    cr = runner.runs[0]
    cr.status, runner.active, cr.generated, cr.raw = "RUNNING", 0, 7, ["w "] * 7
    status = _right(_screen(TUI(runner)))[0]
    assert "THINK 7 (no forced </think>)" in status and "7/" not in status
    runner.backend.forces_think_close = True  # --endpoint-continuation prefix: the cap is real
    status = _right(_screen(TUI(runner)))[0]
    assert "THINK 7/48" in status
