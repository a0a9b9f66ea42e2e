"""The code's layout rules, checked on the source.

* no import cycle among `ds4mlx` modules, function-level imports included;
* no private name (`_x`) imported from another module, no `module._x` reach-in;
* serve/, the engine and chat/*.py import no family module (chat/families/, a family's
  model graph, MTP head, distributed plan or GGUF table);
* no string literal of a chat marker (a family protocol's exact strings) outside the
  family protocol modules;
* every `docs/<file>.md §N` reference in ds4mlx/ names a file and a numbered heading
  that exist, every other `*.md` it names exists;
* the engine (ds4mlx/engine/) imports nothing from serve/ or a model family and
  writes no HTTP API's name as a string;
* a built wheel carries the kernel sources and the chat page (and, slow: installed into a
  fresh venv it serves the demo model and the page, and finds them).

These fail on new code that breaks a rule; each failure names file:line and what to do.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from signal_helpers import ctrl_c_default

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "ds4mlx"


# ----------------------------------------------------------------------------- source index
def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_name(path: Path) -> str:
    mod = module_name(path)
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


SOURCES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


class _Trees(dict):
    """module -> its parsed source, parsed at first use: collection (which every xdist worker
    repeats) parses nothing."""

    def __missing__(self, mod: str):
        tree = self[mod] = ast.parse(SOURCES[mod].read_text(encoding="utf-8"), str(SOURCES[mod]))
        return tree

    def items(self):
        return [(mod, self[mod]) for mod in SOURCES]


TREES = _Trees()


def where(mod: str, node) -> str:
    return f"{SOURCES[mod].relative_to(REPO)}:{node.lineno}"


def type_checking_nodes(tree) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (never executed, not real imports)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports(mod: str):
    """(node, imported module, imported names) for every import statement of `mod`,
    wherever it is (module level, function, class), resolved to absolute names.  A
    `from pkg import sub` of a submodule yields the submodule."""
    tree, skip = TREES[mod], type_checking_nodes(TREES[mod])
    pkg = package_name(SOURCES[mod])
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{target}.{n}" in SOURCES]
            for n in subs:
                yield node, f"{target}.{n}", ()
            rest = tuple(n for n in names if n not in subs)
            if rest or not subs:
                yield node, target, rest


# ----------------------------------------------------------------------------- (a) cycles
def import_graph() -> dict[str, dict[str, list[str]]]:
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in SOURCES}
    for mod in SOURCES:
        for node, target, _ in imports(mod):
            if target in SOURCES and target != mod:
                graph[mod].setdefault(target, []).append(where(mod, node))
    return graph


def strongly_connected(graph) -> list[list[str]]:
    """Tarjan's components with more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = import_graph()
    cycles = strongly_connected(graph)
    report = []
    for comp in cycles:
        edges = [f"    {a} -> {b}  ({', '.join(graph[a][b])})" for a in comp for b in sorted(graph[a]) if b in comp]
        report.append(f"  cycle among {', '.join(comp)}:\n" + "\n".join(edges))
    assert not cycles, (
        "import cycles (function-level imports count: they only hide the cycle).  Move the "
        "shared piece into a module both can import, or pass it in:\n" + "\n".join(report)
    )


# ----------------------------------------------------------------------------- (b) private names
def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree) -> set[str]:
    """Names a module defines anywhere (functions, classes, methods, attributes it assigns)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


def private_violations() -> list[str]:
    found = []
    owners: dict[str, set[str]] = {}
    for mod, tree in TREES.items():
        for name in defined_names(tree):
            if is_private(name):
                owners.setdefault(name, set()).add(mod)
    for mod, tree in TREES.items():
        module_aliases = {}
        for node, target, names in imports(mod):
            if not target.startswith("ds4mlx"):
                continue
            for part in target.split("."):
                if is_private(part):
                    found.append(f"{where(mod, node)}: imports private module {target}")
            for n in names:
                if is_private(n) and target != mod:
                    found.append(f"{where(mod, node)}: imports private {n} from {target}")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and target in SOURCES:
                for a in node.names:
                    if target.endswith("." + a.name) or target == a.name:
                        module_aliases[a.asname or a.name.split(".")[0]] = target
        mine = defined_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in module_aliases:
                found.append(f"{where(mod, node)}: uses private {module_aliases[base.id]}.{node.attr}")
            elif isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            elif node.attr not in mine and owners.get(node.attr):
                found.append(
                    f"{where(mod, node)}: reaches into private {node.attr} of {', '.join(sorted(owners[node.attr]))}"
                )
    return found


def test_no_private_name_across_modules():
    found = private_violations()
    assert not found, (
        "private names used across modules: make the name public (drop the underscore, "
        "document it) or move the code that needs it into the owning module:\n  " + "\n  ".join(found)
    )


# ----------------------------------------------------------------------------- (c) chat markers
# Where a family's exact strings may be written: the family protocol modules.
PROTOCOL_HOMES = ("ds4mlx/chat/markers.py", "ds4mlx/chat/families/")


def chat_markers() -> set[str]:
    """Every family protocol's exact strings: special strings, turn markers, model ids."""
    from ds4mlx.chat import markers
    from ds4mlx.chat.protocol import families, get_protocol

    out = set(markers.SPECIAL_STRINGS)
    for fam in families():
        p = get_protocol(fam)
        out.update(s for s in (p.bos, p.eos, p.think_open, p.think_close, p.turn_end, p.model_id) if s)
        out.update(p.stop_strings)
        out.update(p.special_strings)
        out.update(p.aliases)
    return {s for s in out if s.strip()}


def docstring_nodes(tree) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def distinctive(marker: str) -> bool:
    """Special-token spellings no prose contains: checked as substrings too."""
    return "｜" in marker or "<|" in marker


# ----------------------------------------------------------------------------- (b1) references, not diaries
# this project's issue numbers (1-2 digits: "(#13)", "issue #21"); upstream ones name their project
ISSUE_REF = re.compile(r"(?i)\bissues? #\d{1,2}\b|\(#\d{1,2}\b|(?<![\w/])#\d{1,2}[):]")
SESSION_NAMED = re.compile(r"(?i)(^|[_-])(s\d+|wave\d*|session\d*|final)([_.-]|$)")


def test_no_issue_numbers_in_the_package():
    found = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()[:80]}"
        for p in sorted(PKG.rglob("*"))
        if p.suffix in (".py", ".metal")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if ISSUE_REF.search(line)
    ]
    assert not found, "say what the code does, not which issue asked for it:\n  " + "\n  ".join(found)


def test_reference_documents_stay_short_and_tools_carry_no_session_names():
    assert len((REPO / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()) <= 200, (
        "BENCHMARKS.md is the current figures (<= 200 lines): move older rows to docs/bench-history.md"
    )
    assert len((REPO / "DEVELOPERS.md").read_text(encoding="utf-8").splitlines()) <= 250, (
        "DEVELOPERS.md is a guide (<= 250 lines): put details in docs/"
    )
    named = [p.name for p in (REPO / "tools").iterdir() if SESSION_NAMED.search(p.stem)]
    assert not named, f"tools/ named after a session or wave: {named} (fold them into tools/device.sh phases)"


# ----------------------------------------------------------------------------- (b2) family-neutral stages
def family_modules() -> set[str]:
    """Modules that belong to one model family: the chat families, the model graphs and MTP
    heads, the distributed plans and the GGUF name tables the registry names (by name)."""
    from ds4mlx import registry

    named = {f.chat_module for f in registry.FAMILIES}
    named |= {f.model_module(t) for f in registry.FAMILIES for t in f.model_types}
    named |= {f.mtp_head for f in registry.FAMILIES if f.mtp_head}
    named |= {f.distributed_plan for f in registry.FAMILIES if f.distributed_plan}
    under = ("ds4mlx.chat.families.", "ds4mlx.gguf_families.")
    shared = {"ds4mlx.gguf_families", "ds4mlx.gguf_families.base", "ds4mlx.gguf_families.metadata"}
    return {m for m in SOURCES if m in named or (m.startswith(under) and m not in shared)}


def is_shared_stage(mod: str) -> bool:
    """serve/, the engine, and chat/'s own modules (chat/*.py, not chat/families/) serve every family."""
    parts = mod.split(".")
    return (
        mod.startswith("ds4mlx.serve")
        or mod == "ds4mlx.engine"
        or mod.startswith(("ds4mlx.engine.", "ds4mlx.engine_"))
        or (len(parts) == 3 and parts[1] == "chat")
    )


def test_shared_stages_import_no_family_module():
    fam = family_modules()
    assert "ds4mlx.chat.families.deepseek_v4.dsml" in fam and "ds4mlx.models.deepseek_v4" in fam
    found = [
        f"{where(mod, node)}: {mod} imports {target}"
        for mod in SOURCES
        if is_shared_stage(mod)
        for node, target, _ in imports(mod)
        if target in fam
    ]
    assert not found, (
        "serve/, the engine and chat/*.py serve every family: they reach a family's code through "
        "the registry or ChatProtocol, and what several families share lives in a neutral module "
        "(chat/jsontext.py, chat/dsml_lex.py, chat/dsml_tracker.py, chat/messages.py):\n  " + "\n  ".join(found)
    )


def test_no_chat_marker_literal_outside_family_protocols():
    markers = chat_markers()
    assert {"<think>", "</think>", "<｜end▁of▁sentence｜>", "deepseek-v4-flash"} <= markers
    found = []
    for mod, tree in TREES.items():
        rel = str(SOURCES[mod].relative_to(REPO))
        if rel.startswith(PROTOCOL_HOMES):
            continue
        docs = docstring_nodes(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
                continue
            s = node.value
            hits = [m for m in markers if s == m or (distinctive(m) and m in s)]
            if hits:
                found.append(f"{rel}:{node.lineno}: {s[:60]!r} contains {sorted(hits)}")
    assert not found, (
        "chat markers written outside the family protocols (chat/markers.py, chat/families/): "
        "ask the family's protocol (`protocol_for_model(model)` / `get_protocol(family)`: "
        ".eos, .think_open, .think_close, .model_id, ...) or import the constant from "
        "chat/markers.py:\n  " + "\n  ".join(found)
    )


# ----------------------------------------------------------------------------- (d) doc references
DOC_REF = re.compile(r"docs/([\w.-]+\.md)")
SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)")
MD_NAME = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")
NEAR = 160  # a § belongs to the nearest `docs/<file>.md` at most this many characters before it


def headings(doc: Path) -> set[str]:
    """Section numbers of a doc's numbered headings ('## 2. Title' -> '2', '### 3.1 T' -> '3.1')."""
    out, fence = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        m = re.match(r"#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", line)
        if m and not fence:
            out.add(m.group(1))
    return out


def doc_reference_problems() -> list[str]:
    bad = []
    cache: dict[str, set[str] | None] = {}
    for mod, path in SOURCES.items():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO)
        refs = list(DOC_REF.finditer(text))
        for m in SECTION.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            owner = next((r for r in reversed(refs) if r.end() <= m.start()), None)
            if owner is None or m.start() - owner.end() > NEAR:
                bad.append(f"{rel}:{line}: §{m.group(1)} names no document: write `docs/<file>.md §{m.group(1)}`")
                continue
            name = owner.group(1)
            if name not in cache:
                doc = REPO / "docs" / name
                cache[name] = headings(doc) if doc.is_file() else None
            if cache[name] is None:
                bad.append(f"{rel}:{line}: docs/{name} does not exist")
            elif m.group(1) not in cache[name]:
                bad.append(f"{rel}:{line}: docs/{name} has no heading numbered {m.group(1)}")
        for m in MD_NAME.finditer(text):
            name = m.group(1)
            line = text.count("\n", 0, m.start()) + 1
            if "/" in name:
                ok = (REPO / name).is_file()
            else:
                ok = (REPO / name).is_file() or (path.parent / name).is_file()
            if not ok:
                bad.append(f"{rel}:{line}: {name} is not a file of this repository (docs live in docs/)")
    return bad


def test_every_doc_reference_resolves_inside_the_repo():
    bad = doc_reference_problems()
    assert not bad, "references to documents that do not exist:\n  " + "\n  ".join(bad)


# ----------------------------------------------------------------------------- (e) the engine's seams
ENGINE = "ds4mlx.engine"
# the engine names no HTTP API and knows no model family: what it needs of them comes as data
# (a Job, the model's protocol object, the adapter's opaque binding key)
ENGINE_MAY_NOT_IMPORT = ("ds4mlx.serve", "ds4mlx.chat.families", "ds4mlx.models", "ds4mlx.gguf_families")
HTTP_API_NAMES = ("responses", "anthropic", "openai", "completions")


def engine_modules() -> list[str]:
    return [m for m in SOURCES if m == ENGINE or m.startswith(ENGINE + ".")]


def test_engine_imports_nothing_from_serve_or_a_family():
    found = []
    for mod in engine_modules():
        for node, target, _ in imports(mod):
            if any(target == f or target.startswith(f + ".") for f in ENGINE_MAY_NOT_IMPORT):
                found.append(f"{where(mod, node)}: imports {target}")
    assert len(engine_modules()) > 5, "ds4mlx/engine/ moved: update ENGINE"
    assert not found, (
        "the engine (ds4mlx/engine/) imports no HTTP adapter (serve/) and no model family "
        "(chat/families/, models/, gguf_families/): pass what it needs in (Job fields, the protocol "
        "object, hooks):\n  " + "\n  ".join(found)
    )


def test_engine_names_no_http_api():
    found = []
    for mod in engine_modules():
        docs = docstring_nodes(TREES[mod])
        for node in ast.walk(TREES[mod]):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if node.value.strip().lower() in HTTP_API_NAMES:
                    found.append(f"{where(mod, node)}: {node.value!r}")
    assert not found, (
        "the engine branches on no HTTP API: the adapter supplies the behaviour as Job data "
        "(LiveBinding: an opaque key and flags):\n  " + "\n  ".join(found)
    )


ENGINE_FUNCTION_LINES = 100  # a function longer than this is several steps of the state machine in one


def test_engine_functions_stay_short():
    long = [
        f"{where(mod, n)}: {n.name} has {n.end_lineno - n.lineno + 1} lines"
        for mod in engine_modules()
        for n in ast.walk(TREES[mod])
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > ENGINE_FUNCTION_LINES
    ]
    assert not long, f"engine functions over {ENGINE_FUNCTION_LINES} lines: split them:\n  " + "\n  ".join(long)


# ----------------------------------------------------------------------------- (f) the wheel
KERNEL_SOURCES = sorted(p.name for p in (PKG / "kernels" / "metal").glob("*.metal"))
CHAT_PAGE = sorted(p.name for p in (PKG / "serve" / "webchat").iterdir())  # serve/page.py serves them


def build_wheel(out: Path) -> Path:
    """`pip wheel . --no-deps` of a copy of the tree (the build leaves build/ and
    *.egg-info behind, which must not land in the checkout)."""
    import shutil

    src = out / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".gpu", "out", "tests"),
    )
    import importlib.util

    # build offline with this interpreter's setuptools when it has one (else pip fetches it)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation, "-q", "-w", str(out / "dist")],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = (out / "dist").glob("ds4mlx-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_carries_the_kernel_sources(wheel):
    assert KERNEL_SOURCES, "no kernel sources under ds4mlx/kernels/metal/"
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [k for k in KERNEL_SOURCES if f"ds4mlx/kernels/metal/{k}" not in names]
    assert not missing, f"the wheel lacks {missing}: list them under [tool.setuptools.package-data] in pyproject.toml"
    assert "ds4mlx/eval/cases/core.json" in names and "ds4mlx/data/bench_text.txt" in names
    assert "index.html" in CHAT_PAGE and "chat.js" in CHAT_PAGE
    missing = [f for f in CHAT_PAGE if f"ds4mlx/serve/webchat/{f}" not in names]
    assert not missing, f"the wheel lacks the chat page's {missing}: see [tool.setuptools.package-data]"


@pytest.mark.slow
def test_installed_wheel_serves_the_demo_model(wheel, tmp_path):
    """A fresh venv gets the wheel (the dependencies come from this interpreter's
    site-packages through a .pth line, so nothing is downloaded); from outside the
    checkout, `ds4mlx serve` answers one chat completion and the kernels find their
    sources in the installed package."""
    import json
    import os
    import signal
    import site
    import socket
    import time
    import urllib.request

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(purelib, "zz_ds4mlx_test_deps.pth").write_text("\n".join(deps) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,  # neither the cwd nor PYTHONPATH on pip's path: a checkout's *.egg-info
        env=env,  # there reads as "already installed" and the wheel is not installed
    )
    probe = subprocess.run(
        [
            py,
            "-c",
            "import ds4mlx, ds4mlx.kernels.dispatch as d; print(ds4mlx.__file__); print(d.METAL_DIR); "
            "print(sorted(p.name for p in d.METAL_DIR.glob('*.metal')))",
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert probe[0].startswith(purelib), f"ds4mlx imported from {probe[0]}, not from the installed wheel"
    assert probe[1].startswith(purelib) and probe[2] == str(KERNEL_SOURCES)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [venv / "bin" / "ds4mlx", "serve", "--port", str(port), "--ctx", "512", "--tokens", "3"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ctrl_c_default,  # stopped with SIGINT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"ds4mlx serve exited: {proc.stdout.read()}"
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < end, "ds4mlx serve did not come up"
                time.sleep(0.3)
        req = urllib.request.Request(
            url + "/v1/chat/completions",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
        )
        body = json.loads(urllib.request.urlopen(req, timeout=300).read())
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        assert 1 <= body["usage"]["completion_tokens"] <= 3
        page = urllib.request.Request(url + "/", headers={"Accept": "text/html"})
        assert b'<script src="ui/chat.js"' in urllib.request.urlopen(page, timeout=30).read()
        for name in CHAT_PAGE:  # the page's files, read from the installed package
            assert (
                urllib.request.urlopen(f"{url}/ui/{name}", timeout=30).read()
                == (PKG / "serve" / "webchat" / name).read_bytes()
            )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
