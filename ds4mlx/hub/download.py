"""Downloads and the local cache, through huggingface_hub (its cache layout, resumable
`.incomplete` blobs, progress bars, HF_TOKEN / HF_ENDPOINT / HF_HUB_OFFLINE / HF_HOME).

`plan(spec)` asks the hub for the repository's files at one commit, with their sizes and
hashes (`model_info(files_metadata=True)`); `pull(spec)` checks the free disk before the
first byte, downloads the files one by one (`hf_hub_download`: an interrupted file resumes
from its `.incomplete` blob with a Range request) and verifies each against the hub's
hash (the LFS sha256, or the git blob id of a small file): a file that does not match is
removed from the cache and the pull fails naming it.  `cached(spec)` is the local copy,
without the network."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .spec import HubError, Spec, pick_model, select

GB = 1e9
HASH_BLOCK = 16 << 20


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files: the content's sha256 (also their ETag)
    blob_id: str | None  # small files: the git blob sha1 (their ETag)

    @property
    def etag(self) -> str | None:
        return self.sha256 or self.blob_id


@dataclass
class Plan:
    spec: Spec
    commit: str
    files: list[RemoteFile]
    cache_dir: Path
    have: dict = field(default_factory=dict)  # name -> bytes already local (complete or partial)

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def to_fetch(self) -> int:
        return sum(f.size - self.have.get(f.name, 0) for f in self.files)


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the filesystem that will hold `path` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _storage(spec: Spec, cache: Path) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache / repo_folder_name(repo_id=spec.repo, repo_type="model")


def _hub_error(spec: Spec, e: Exception) -> HubError:
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return HubError(f"{spec.repo} is gated: accept its terms on the hub and set HF_TOKEN")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(f"{spec.repo}: no such repository on the hub (or it is private: set HF_TOKEN)")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"{spec.repo}: no such revision")
    if isinstance(e, errors.OfflineModeIsEnabled):
        return HubError(f"{spec.name}: HF_HUB_OFFLINE is set, so nothing can be downloaded")
    msg = " ".join(str(e).split()) or type(e).__name__
    return HubError(f"{spec.name}: {msg}")


def plan(spec: Spec, cache: Path | None = None) -> Plan:
    """The files to fetch and what is already here (complete blobs, partial `.incomplete`s)."""
    import httpx
    from huggingface_hub import HfApi, errors

    cache = Path(cache or cache_dir())
    if offline():
        raise HubError(f"{spec.name}: HF_HUB_OFFLINE is set, so nothing can be downloaded")
    try:
        info = HfApi().model_info(spec.repo, files_metadata=True)
    except (errors.HfHubHTTPError, errors.OfflineModeIsEnabled, httpx.HTTPError, OSError) as e:
        raise _hub_error(spec, e) from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = []
    for name in select(spec, siblings):
        s = siblings[name]
        size = s.lfs.size if s.lfs else s.size
        files.append(RemoteFile(name, int(size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id))
    p = Plan(spec, info.sha, files, cache)
    storage = _storage(spec, cache)
    for f in files:
        done = storage / "snapshots" / p.commit / f.name
        part = storage / "blobs" / f"{f.etag}.incomplete"
        if done.exists() or (f.etag and (storage / "blobs" / f.etag).exists()):  # a blob another revision shares
            p.have[f.name] = f.size
        elif f.etag and part.exists():
            p.have[f.name] = min(part.stat().st_size, f.size)
    return p


def check_space(p: Plan) -> None:
    free = free_disk_bytes(p.cache_dir)
    if p.to_fetch > free:
        raise HubError(
            f"{p.spec.name}: {p.to_fetch / GB:.1f} GB to download but {free / GB:.1f} GB free at {p.cache_dir}; "
            "free some space or set HF_HOME to a larger disk"
        )


def git_blob_sha1(path: Path, size: int) -> str:
    h = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_BLOCK):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_BLOCK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def verify(path: Path, f: RemoteFile, quiet: bool = False) -> None:
    """HubError (one line) when the local file is not the hub's: its sha256 (LFS) or git
    blob id (small files) differs, or its size."""
    size = os.path.getsize(path)
    if size != f.size:
        raise HubError(f"{f.name}: {size} bytes on disk, the hub says {f.size}")
    if f.sha256:
        from huggingface_hub.utils import tqdm

        with tqdm(total=size, unit="B", unit_scale=True, desc=f"verify {f.name[-40:]}", disable=quiet) as bar:
            got, want = file_sha256(path, bar.update), f.sha256
    elif f.blob_id:
        got, want = git_blob_sha1(path, size), f.blob_id
    else:
        return
    if got != want:
        raise HubError(f"{f.name}: hash mismatch (expected {want[:16]}..., got {got[:16]}...)")


def _discard(path: Path) -> None:
    """Remove a bad file from the cache: the blob and the snapshot's link to it."""
    blob = Path(os.path.realpath(path))
    for p in (path, blob):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _progress_class():
    """The hub's tqdm, shown on a pipe too (as curl's progress meter is); still off under
    HF_HUB_DISABLE_PROGRESS_BARS."""
    from huggingface_hub.utils import tqdm

    class Progress(tqdm):
        def __init__(self, *a, **kw):
            if kw.get("disable") is None:
                kw["disable"] = False
            super().__init__(*a, **kw)

    return Progress


def _fetch(spec: Spec, f: RemoteFile, commit: str, storage: Path, quiet: bool) -> Path:
    """One file into the hub cache at `commit`, verified; its snapshot path.

    Xet-backed files (the hub's large files, hf_xet installed) go through `hf_hub_download`.
    Plain HTTP files are fetched with the library's `http_get` into `blobs/<etag>.incomplete`,
    which a later pull resumes with a Range request (huggingface_hub 2.x downloads into a
    per-process temporary file it deletes on failure, so its own resume does not survive a
    kill); the finished blob is verified before it is linked into the snapshot, so a corrupt
    file never enters the cache."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    pointer = storage / "snapshots" / commit / f.name
    if pointer.exists():  # here already: checked again
        verify(pointer, f, quiet)
        return pointer
    meta = get_hf_file_metadata(hf_hub_url(spec.repo, f.name, revision=commit))
    if meta.xet_file_data is not None and not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet"):
        path = Path(hf_hub_download(spec.repo, f.name, revision=commit, cache_dir=storage.parent))
        verify(path, f, quiet)
        return path
    etag = meta.etag or f.etag
    blob = storage / "blobs" / etag
    lock = storage.parent / ".locks" / storage.name / f"{etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if not blob.exists():
            part = blob.with_name(f"{etag}.incomplete")
            with open(part, "ab") as out:
                http_get(
                    meta.location,
                    out,
                    resume_size=out.tell(),
                    headers=build_hf_headers(),
                    expected_size=meta.size,
                    displayed_filename=f.name,
                    tqdm_class=None if quiet else _progress_class(),
                )
            try:
                verify(part, f, quiet)
            except HubError:
                part.unlink(missing_ok=True)
                raise
            os.replace(part, blob)
        else:  # a blob already here (another revision's): checked too
            verify(blob, f, quiet)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        if not pointer.exists():
            os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    return pointer


def _record_ref(storage: Path, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, as the hub cache records a branch (offline lookups read it)."""
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.exists() or ref.read_text().strip() != commit:
        ref.write_text(commit)


def pull(spec: Spec, quiet: bool = False, say=print) -> Path:
    """Download what `spec` selects into the hub cache, verified; the local model path."""
    import httpx
    from huggingface_hub import errors

    p = plan(spec)
    check_space(p)
    say(
        f"{spec.name}: {len(p.files)} file(s) from {spec.repo} @ {p.commit[:12]}, {p.total / GB:.2f} GB"
        + (f", {p.to_fetch / GB:.2f} GB to download" if p.to_fetch != p.total else "")
    )
    storage = _storage(spec, p.cache_dir)
    for f in p.files:
        try:
            _fetch(spec, f, p.commit, storage, quiet)
        except HubError as e:  # a file that is not the hub's: out of the cache
            pointer = storage / "snapshots" / p.commit / f.name
            if pointer.exists():
                _discard(pointer)
            elif f.etag and (storage / "blobs" / f.etag).exists():
                os.unlink(storage / "blobs" / f.etag)
            raise HubError(f"{spec.name}: {e}; removed it from the cache (pull again to fetch it anew)") from None
        except (errors.HfHubHTTPError, errors.OfflineModeIsEnabled, httpx.HTTPError, OSError, ValueError) as e:
            raise _hub_error(spec, e) from None
    _record_ref(storage, "main", p.commit)
    return pick_model(storage / "snapshots" / p.commit, spec)


def cached(spec: Spec) -> Path | None:
    """The local model path of `spec` from the hub cache, without the network; None when
    the cache holds no snapshot of the repository or none of the files the spec selects."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(spec.repo, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    if spec.exact and not all((folder / f).exists() for f in spec.patterns):
        return None
    if not any(spec.selects(str(q.relative_to(folder))) for q in folder.rglob("*") if q.is_file()):
        return None
    return pick_model(folder, spec)


__all__ = ["Plan", "RemoteFile", "plan", "pull", "cached", "check_space", "free_disk_bytes", "verify", "cache_dir"]
