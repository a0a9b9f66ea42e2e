"""`ds4mlx models`: the models in the local hub cache, each with the name to pass to -m, its
size on disk and the memory serving it takes at --ctx (inspect's figures, the load's
verdict: memory_fit.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .spec import split_parts

GB = 1e9


def local_models(cache_dir=None) -> list[dict]:
    """One entry per loadable model in the hub cache: a GGUF (a split's parts together) or a
    Hugging Face folder (config.json + safetensors), with the files' bytes on disk."""
    from huggingface_hub import scan_cache_dir

    from .catalogue import CATALOGUE
    from .download import cache_dir as default_cache

    root = Path(cache_dir or default_cache())
    if not root.is_dir():
        return []
    known = {(e.repo, e.files[0]): name for name, e in CATALOGUE.items() if len(e.files) == 1}
    out = []
    for repo in sorted(scan_cache_dir(root).repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: -r.last_modified):
            if "main" not in rev.refs and len(repo.revisions) > 1:
                continue
            files = {str(f.file_path.relative_to(rev.snapshot_path)): f.size_on_disk for f in rev.files}
            models = []
            if "config.json" in files and any(n.endswith(".safetensors") for n in files):
                models.append((repo.repo_id, rev.snapshot_path, sum(files.values())))
            ggufs = sorted({split_parts(n, files)[0] for n in files if n.endswith(".gguf")})
            for g in ggufs:
                parts = split_parts(g, files)
                name = known.get((repo.repo_id, g)) or (
                    repo.repo_id if len(ggufs) == 1 and not models else f"{repo.repo_id}:{g}"
                )
                models.append((name, rev.snapshot_path / g, sum(files[p] for p in parts)))
            for name, path, size in models:
                out.append({"name": name, "path": str(path), "disk_bytes": size})
    return out


def _memory(path: str, ctx: int) -> dict:
    from ..io.inspect_model import summarize

    try:
        s = summarize(path, ctx)
    except Exception as e:  # noqa: BLE001 - a support file (MTP head), an incomplete split: shown, not fatal
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return {"serve_bytes": None, "fits": None, "max_ctx": None, "note": first[:80]}
    return {"serve_bytes": s["serve_bytes"], "fits": s["fits"], "max_ctx": s["max_ctx"], "family": s["family"]}


def add_arguments(p) -> None:
    p.add_argument("--ctx", type=int, default=32768, help="context length to size the KV cache for")
    p.add_argument("--json", action="store_true", help="one JSON object per model")


def run(args) -> int:
    rows = [{**m, **_memory(m["path"], args.ctx)} for m in local_models()]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print("no models in the local hub cache (`ds4mlx pull` lists what it can fetch)", file=sys.stderr)
        return 0
    width = max(len("NAME (-m)"), *(len(r["name"]) for r in rows))
    print(f"{'NAME (-m)':<{width}}  {'DISK':>9}  {f'AT --ctx {args.ctx}':>16}  FITS HERE")
    for r in rows:
        mem = "-" if r["serve_bytes"] is None else f"{r['serve_bytes'] / GB:.1f} GB"
        if r["fits"] is None:
            fits = r.get("note", "")
        elif r["fits"]:
            fits = "yes"
        else:
            fits = f"no (--ctx {r['max_ctx']} fits)" if r["max_ctx"] else "no (--stream-experts)"
        print(f"{r['name']:<{width}}  {r['disk_bytes'] / GB:>6.1f} GB  {mem:>16}  {fits}")
    return 0


__all__ = ["local_models", "add_arguments", "run"]
