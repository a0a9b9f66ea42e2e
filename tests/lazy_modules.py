"""`lazy("openai")`: a module imported at its first attribute access, not at collection.

Test files that need heavy optional libraries (torch, transformers, the OpenAI and Anthropic
SDKs: seconds of import each) bind them with `lazy(name)` instead of a module-level
`pytest.importorskip(name)`.  Collection, which every xdist worker repeats for every file, then
imports none of them; the test that touches the module imports it, and is skipped (as with
importorskip) when it is not installed.
"""

from __future__ import annotations

import pytest


class LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        # pytest probes every module-level object during collection (`__test__`, fixture
        # markers, `pytestmark`, ...): those probes must not import the module
        if attr.startswith(("_", "pytest")):
            raise AttributeError(attr)
        return getattr(pytest.importorskip(self._name), attr)


def lazy(name: str) -> LazyModule:
    return LazyModule(name)


def requires(*names: str):
    """An autouse fixture skipping each test of the module that binds it when one of `names`
    cannot be imported: the module-level `pytest.importorskip(name)` without its import at
    collection.  Use: `needs = requires("torch")` at module level."""

    @pytest.fixture(autouse=True, name="requires_" + "_".join(n.replace(".", "_") for n in names))
    def fixture():
        for name in names:
            pytest.importorskip(name)

    return fixture
