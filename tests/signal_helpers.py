"""Children that a test stops with SIGINT (Ctrl+C) start the way a command typed at a
terminal does: SIGINT at its default action and not blocked.

A POSIX shell without job control starts a background command (`cmd &`, as in
`(setsid nohup bash -c '... pytest' &)`) with SIGINT and SIGQUIT ignored; Python keeps an
ignored SIGINT (it installs KeyboardInterrupt only over SIG_DFL) and every child inherits
the disposition and the signal mask.  So under such a launch `ds4mlx eval` did not stop on
SIGINT and `ds4mlx chat` did not clear the line on Ctrl+C at its prompt, as the same commands
would not for a user who starts them in the background: the product honours an inherited
SIG_IGN like any Unix command; the tests are about the Ctrl+C a user presses at a terminal,
so they give their child that state, whatever state pytest itself was started with.
"""

from __future__ import annotations

import signal


def ctrl_c_default() -> None:
    """`preexec_fn` (subprocess.Popen, pexpect.spawn): in the child, before exec, SIGINT at
    SIG_DFL (exec keeps SIG_DFL; Python then installs KeyboardInterrupt) and unblocked
    (exec keeps the mask)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
