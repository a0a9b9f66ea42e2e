"""Keep file tools inside the project directory.

A path is resolved the way the kernel would follow it: every existing
component's symlinks are followed (`os.path.realpath`, which also resolves a
dangling link and leaves a non-existent tail as written), then the result must
lie under the resolved project root.  A link inside the project that points
outside is an escape like `../x`.
"""

from __future__ import annotations

import os


class PathEscape(ValueError):
    """A tool path resolves outside the project directory."""


class ProjectRoot:
    def __init__(self, root: str):
        self.root = os.path.realpath(os.path.abspath(root))

    def resolve(self, path: str) -> str:
        """The real absolute path of `path` (relative to the root), or PathEscape."""
        if not isinstance(path, str) or not path:
            raise PathEscape("path is required")
        full = path if os.path.isabs(path) else os.path.join(self.root, path)
        real = os.path.realpath(full)
        if real != self.root and not real.startswith(self.root + os.sep):
            raise PathEscape(f"path {path!r} resolves outside the project directory {self.root} ({real}): refused")
        return real

    def relative(self, real: str) -> str:
        rel = os.path.relpath(real, self.root)
        return "." if rel == "." else rel
