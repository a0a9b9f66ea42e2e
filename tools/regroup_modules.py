#!/usr/bin/env python3
"""Regroup ds4mlx's flat top-level modules into packages by stage: `io/` (model files in
and out), `runtime/` (running a loaded model) and `cli/` (the command line).

Run from anywhere inside the checkout: `python tools/regroup_modules.py` (`--dry-run`
prints the moves and, roughly, the files whose references change; it writes nothing).  It

1. `git mv`s every module of MOVES to its new place and writes the new packages'
   `__init__.py` (and `cli/__main__.py`, so `python -m ds4mlx.cli` keeps working);
2. rewrites every reference in the files git knows (tracked, or untracked and not ignored)
   outside tests/data/: Python imports, absolute (`ds4mlx.session`, `from ds4mlx import
   session`) and relative (`from .session import`, `from .. import session`, resolved
   against the file's old package and written again against its new one), dotted names in
   strings and prose (`mock.patch("ds4mlx.session.X")`, `python -m ds4mlx.generate`), file
   paths (`ds4mlx/session.py`) and pyproject's entry point;
3. runs `ruff check --select I --fix` and `ruff format` on the Python files it changed
   under ds4mlx/ and tests/ (when ruff is installed), since a rewritten import may sort
   elsewhere;
4. prints every file it moved or changed.

It can be run again: a module already in its new place is not moved again, a reference
already rewritten is left alone, and a relative import that a moved file gained afterwards
(a branch merged after the move) is resolved against the file's old package when it
names nothing in the new one.  No module is left at an old path (no re-export shims).
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "ds4mlx"

# old top-level module -> new module (relative to ds4mlx)
MOVES = {
    # io/: model files in and out
    "atomic_file": "io.atomic_file",
    "checkpoint_names": "io.checkpoint_names",
    "convert": "io.convert",
    "demo": "io.demo",
    "dtype_policy": "io.dtype_policy",
    "inspect_model": "io.inspect_model",
    "loader": "io.loader",
    "mapped": "io.mapped",
    "memory_fit": "io.memory_fit",
    "modelfile": "io.modelfile",
    "quant": "io.quant",
    "quantize": "io.quantize",
    "split_names": "io.split_names",
    "weights": "io.weights",
    # runtime/: running a loaded model
    "decode": "runtime.decode",
    "detok": "runtime.detok",
    "events": "runtime.events",
    "prefill_chunk": "runtime.prefill_chunk",
    "sampling": "runtime.sampling",
    "session": "runtime.session",
    "steering": "runtime.steering",
    "stepper": "runtime.stepper",
    "structured": "runtime.structured",
    "tokenizer": "runtime.tokenizer",
    # cli/: the command line
    "cli": "cli.commands",
    "cli_options": "cli.options",
    "generate": "cli.generate",
    "prefix_file": "cli.prefix_file",
    "repl": "cli.repl",
    "steer_cli": "cli.steer",
    "think_flags": "cli.think_flags",
}

PACKAGE_DOCS = {
    "io": '"""Model files in and out: reading GGUF and safetensors checkpoints (weights, mapped,\n'
    "loader), the names and quantization formats they use, writing converted and quantized\n"
    'files, the demo model, and the memory a model needs."""\n',
    "runtime": '"""Running a loaded model: the session (prefill, decode step, caches), the decode loop,\n'
    "sampling, the tokenizer and detokenizer, steering, structured output and the engine's\n"
    'event stream."""\n',
    "cli": '"""The `ds4mlx` command line: the dispatcher (commands.py), generate / chat and its REPL,\n'
    'directional steering, and the flags several commands share."""\n',
}
EXTRA_FILES = {
    "cli/__main__.py": '"""`python -m ds4mlx.cli`: the `ds4mlx` command."""\n\nimport sys\n\n'
    "from .commands import main\n\nsys.exit(main())\n",
}

OLD2NEW = {f"{PKG}.{old}": f"{PKG}.{new}" for old, new in MOVES.items()}
# an old module whose name is now a package (ds4mlx.cli): its dotted name stays valid
PACKAGE_NAMES = {f"{PKG}.{p}" for p in PACKAGE_DOCS} & set(OLD2NEW)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".json", ".html", ".js"}
TEXT_NAMES = {"Makefile", "run"}
SKIP_UNDER = ("tests/data/",)
LINTED = ("ds4mlx", "tests")  # what CI's ruff checks (tools/ is left as written)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def path_of(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def module_exists(module: str) -> bool:
    return path_of(module).exists() or (ROOT / module.replace(".", "/") / "__init__.py").exists()


def defines(package: str, name: str) -> bool:
    """`from package import name` finds something: a submodule or a name its __init__ binds."""
    if module_exists(f"{package}.{name}"):
        return True
    init = ROOT / package.replace(".", "/") / "__init__.py"
    return init.exists() and re.search(rf"\b{re.escape(name)}\b", init.read_text(encoding="utf-8")) is not None


# --- 1. the moves ---------------------------------------------------------------------------
def move_files(dry: bool, log: list[str]) -> set[Path]:
    moved: set[Path] = set()
    for pkg, doc in PACKAGE_DOCS.items():
        init = ROOT / PKG / pkg / "__init__.py"
        if not init.exists():
            log.append(f"create {init.relative_to(ROOT)}")
            if not dry:
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_text(doc, encoding="utf-8")
    for old, new in MOVES.items():
        src, dst = ROOT / PKG / f"{old}.py", path_of(f"{PKG}.{new}")
        if not src.exists():
            continue
        if dst.exists():
            sys.exit(f"regroup: both {src.relative_to(ROOT)} and {dst.relative_to(ROOT)} exist; merge them by hand")
        log.append(f"move {src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
        moved.add(dst)
        if not dry:
            git("mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT)))
    for rel, text in EXTRA_FILES.items():
        f = ROOT / PKG / rel
        if not f.exists():
            log.append(f"create {f.relative_to(ROOT)}")
            if not dry:
                f.write_text(text, encoding="utf-8")
    if not dry:
        git("add", *[str((ROOT / PKG / p / "__init__.py").relative_to(ROOT)) for p in PACKAGE_DOCS])
        git("add", *[str((ROOT / PKG / rel).relative_to(ROOT)) for rel in EXTRA_FILES])
    return moved


# --- 2a. Python imports ---------------------------------------------------------------------
def package_of(path: Path) -> str | None:
    rel = path.relative_to(ROOT)
    if rel.parts[0] != PKG:
        return None
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] != "__init__" else parts)


NEW_HOMES = {path_of(new) for new in OLD2NEW.values()}


def resolve(level: int, module: str | None, package: str) -> str | None:
    parts = package.split(".")
    if level - 1 > len(parts) - 1:
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def relative(target: str, package: str) -> str:
    t, p = target.split("."), package.split(".")
    common = 0
    while common < min(len(t), len(p)) and t[common] == p[common]:
        common += 1
    return "." * (len(p) - common + 1) + ".".join(t[common:])


def new_name(module: str) -> str:
    """A dotted module name after the move (a submodule of a moved module cannot exist)."""
    return OLD2NEW.get(module, module)


def remap(absmod: str, names: list[tuple[str, str | None]]) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """`from absmod import names` (old names) -> [(new module, names)], grouped."""
    groups: dict[str, list[tuple[str, str | None]]] = {}
    for name, asname in names:
        full = f"{absmod}.{name}"
        if full in OLD2NEW:  # a module that moves: from ds4mlx import session
            parent, _, leaf = OLD2NEW[full].rpartition(".")
            groups.setdefault(parent, []).append((leaf, asname or (name if leaf != name else None)))
        elif absmod in PACKAGE_NAMES and module_exists(full):  # from ds4mlx.cli import repl (already new)
            groups.setdefault(absmod, []).append((name, asname))
        else:
            groups.setdefault(new_name(absmod), []).append((name, asname))
    return list(groups.items())


def stale(absmod: str | None, names: list[tuple[str, str | None]]) -> bool:
    """A resolved import that names nothing in the tree as it is now."""
    if absmod is None or not module_exists(absmod):
        return True
    if (ROOT / absmod.replace(".", "/") / "__init__.py").exists():
        return not all(n == "*" or defines(absmod, n) for n, _ in names)
    return False


def names_text(names: list[tuple[str, str | None]]) -> str:
    return ", ".join(n if a is None else f"{n} as {a}" for n, a in names)


def rewrite_imports(path: Path, text: str, moved_now: bool) -> str:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    cur = package_of(path)
    in_new_home = path in NEW_HOMES
    old_pkg = PKG if in_new_home else cur
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []  # (first line, last line, replacement lines), 0-based
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        names = [(a.name, a.asname) for a in node.names]
        if node.level == 0:
            if not (node.module == PKG or (node.module or "").startswith(PKG + ".")):
                continue
            absmod, relative_out = node.module, False
        else:
            if cur is None:
                continue
            absmod = None
            if not moved_now:
                absmod = resolve(node.level, node.module, cur)
                if in_new_home and stale(absmod, names):
                    absmod = None
            if absmod is None:
                absmod = resolve(node.level, node.module, old_pkg)
            if absmod is None:
                continue
            relative_out = True
        groups = remap(absmod, names)
        if not in_new_home or not relative_out:
            if len(groups) == 1 and groups[0][0] == absmod and groups[0][1] == names:
                continue  # nothing moved under it
        spelled = [(relative(m, cur) if relative_out else m, ns) for m, ns in groups]
        first, last = node.lineno - 1, node.end_lineno - 1
        head = lines[first]
        indent = head[: len(head) - len(head.lstrip())]
        m = re.match(r"\s*from\s+([.\w]+)\s+import\b", head)
        if m is None:
            continue
        if len(spelled) == 1 and spelled[0][1] == names:  # only the module part changes
            if spelled[0][0] == m.group(1):
                continue
            new_head = head[: m.start(1)] + spelled[0][0] + head[m.end(1) :]
            edits.append((first, first, [new_head]))
            continue
        comment = ""
        tail = lines[first].rstrip("\n")
        if "#" in tail and first == last:
            comment = "  " + tail[tail.index("#") :]
        new = [f"{indent}from {mod} import {names_text(ns)}{comment}\n" for mod, ns in spelled]
        edits.append((first, last, new))
    for first, last, new in sorted(edits, reverse=True):
        lines[first : last + 1] = new
    return "".join(lines)


# --- 2b. dotted names and paths in any text ---------------------------------------------------
_PLAIN = sorted((o for o in MOVES if f"{PKG}.{o}" not in PACKAGE_NAMES), key=len, reverse=True)
DOTTED = re.compile(rf"(?<![\w.]){PKG}\.({'|'.join(_PLAIN)})(?![\w])")
PATHS = re.compile(rf"(?<![\w/]){PKG}/({'|'.join(sorted(MOVES, key=len, reverse=True))})\.py\b")


def _package_module_refs(text: str) -> str:
    """ds4mlx.cli (now a package): its entry point and attributes move to ds4mlx.cli.commands;
    `python -m ds4mlx.cli` and the package's own submodules stay."""
    for old in sorted(PACKAGE_NAMES):
        new = OLD2NEW[old]
        src = (ROOT / new.replace(".", "/")).with_suffix(".py")
        if not src.exists():
            src = path_of(old)
        attrs = set()
        if src.exists():
            tree = ast.parse(src.read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    attrs.add(node.name)
                elif isinstance(node, ast.Assign):
                    attrs |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        text = re.sub(rf"(?<![\w.]){re.escape(old)}:(\w+)", lambda mt, n=new: f"{n}:{mt.group(1)}", text)
        if attrs:
            alt = "|".join(sorted(attrs, key=len, reverse=True))
            text = re.sub(rf"(?<![\w.]){re.escape(old)}\.({alt})(?![\w])", lambda mt, n=new: f"{n}.{mt.group(1)}", text)
    return text


def rewrite_text(text: str) -> str:
    text = DOTTED.sub(lambda m: f"{PKG}.{MOVES[m.group(1)]}", text)
    text = PATHS.sub(lambda m: f"{PKG}/{MOVES[m.group(1)].replace('.', '/')}.py", text)
    return _package_module_refs(text)


# --- driver ---------------------------------------------------------------------------------
def candidate_files() -> list[Path]:
    out = []
    for rel in git("ls-files", "--cached", "--others", "--exclude-standard").splitlines():
        p = ROOT / rel
        if rel.startswith(SKIP_UNDER) or not p.is_file() or p == Path(__file__).resolve():
            continue
        if p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES:
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    args = ap.parse_args(argv)
    log: list[str] = []
    moved = move_files(args.dry_run, log)
    changed_py: list[Path] = []
    for p in candidate_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        new = rewrite_imports(p, text, p in moved) if p.suffix == ".py" else text
        new = rewrite_text(new)
        if new != text:
            log.append(f"rewrite {p.relative_to(ROOT)}")
            if not args.dry_run:
                p.write_text(new, encoding="utf-8")
                if p.suffix == ".py":
                    changed_py.append(p)
    venv_ruff = Path(sys.executable).with_name("ruff")
    ruff = shutil.which("ruff") or (str(venv_ruff) if venv_ruff.exists() else None)
    files = [str(p.relative_to(ROOT)) for p in changed_py if p.relative_to(ROOT).parts[0] in LINTED]
    if files and not args.dry_run:
        if ruff:
            subprocess.run([ruff, "check", "-q", "--select", "I", "--fix", *files], cwd=ROOT, check=False)
            subprocess.run([ruff, "format", "-q", *files], cwd=ROOT, check=False)
        else:
            log.append("ruff not found: run `ruff check --select I --fix` and `ruff format` on the files above")
    print("\n".join(log) if log else "regroup: nothing to do")
    return 0


if __name__ == "__main__":
    sys.exit(main())
