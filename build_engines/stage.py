"""Checksums and staging: copy a built folder to the weights store (local path or any fsspec URL) and to the
node-local cache, verify sha256 checksums, and make each copy appear whole or not at all.

A staged folder is complete when its MANIFEST.json exists: it is written last (and, on a local
filesystem, the folder is renamed into place at once), so a reader never sees half a copy.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

MANIFEST = "MANIFEST.json"
CHUNK = 8 << 20
console = Console(stderr=True, soft_wrap=True)


def progress() -> Progress:
    """A byte-counting progress bar on stderr (quiet when stderr is not a terminal)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, transient=False, disable=not console.is_terminal)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def sha256_file(path: Path, bar: Progress | None = None, task: Any = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            if bar is not None:
                bar.advance(task, len(chunk))
    return h.hexdigest()


def manifest_of(root: Path, label: str = "checksums") -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, size}} of every file under root, with a progress bar."""
    files = _files(root)
    out: dict[str, dict[str, Any]] = {}
    with progress() as bar:
        task = bar.add_task(f"sha256 {label}", total=sum(p.stat().st_size for p in files))
        for p in files:
            out[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p, bar, task), "size": p.stat().st_size}
    return out


def tree_digest(manifest: dict[str, dict[str, Any]]) -> str:
    """One sha256 over a manifest (paths + file checksums): the checksum of a whole folder."""
    return hashlib.sha256(json.dumps({k: v["sha256"] for k, v in sorted(manifest.items())}).encode()).hexdigest()


def checkpoint_sha256(path: Path, memo_file: Path) -> str:
    """sha256 of a checkpoint file (or of a folder's manifest), memoised by (path, size, mtime) in memo_file."""
    files = [path] if path.is_file() else _files(path)
    key = json.dumps([[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    memo: dict[str, str] = {}
    if memo_file.is_file():
        try:
            memo = json.loads(memo_file.read_text())
        except (OSError, json.JSONDecodeError):
            memo = {}
    if key in memo:
        return memo[key]
    if path.is_file():
        with progress() as bar:
            digest = sha256_file(path, bar, bar.add_task(f"sha256 {path.name}", total=path.stat().st_size))
    else:
        digest = tree_digest(manifest_of(path, path.name))
    memo[key] = digest
    memo_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_file.with_name(f"{memo_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo))
    tmp.replace(memo_file)
    return digest


@contextmanager
def file_lock(path: Path, blocking: bool = True) -> Iterator[bool]:
    """An flock on `path`; yields False (without waiting) when not blocking and someone else holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def copy_tree_local(src: Path, dst: Path, label: str) -> None:
    """Copy src into a new folder dst (must not exist) with a byte progress bar."""
    files = _files(src)
    with progress() as bar:
        task = bar.add_task(f"copy {label}", total=sum(p.stat().st_size for p in files))
        for p in files:
            out = dst / p.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            with p.open("rb") as fi, out.open("wb") as fo:
                while chunk := fi.read(CHUNK):
                    fo.write(chunk)
                    bar.advance(task, len(chunk))
            shutil.copystat(p, out)


def is_local_uri(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def stage_to_store(src: Path, uri: str, manifest: dict[str, dict[str, Any]]) -> str:
    """Upload src to `uri` (local path or fsspec URL), verify every file's sha256, then write MANIFEST.json.

    Local: written into a hidden sibling and renamed into place (an existing copy is replaced).
    Object store: files are uploaded, read back and checked, and MANIFEST.json, the commit marker, goes last.
    """
    if is_local_uri(uri):
        dst = local_path(uri)
        tmp = dst.with_name(f".{dst.name}.partial-{uuid.uuid4().hex[:8]}")
        try:
            copy_tree_local(src, tmp, f"→ store {dst}")
            verify(tmp, manifest, "store copy")
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            replace_dir(tmp, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return str(dst)
    fs, root = fsspec.core.url_to_fs(uri)
    if fs.exists(f"{root}/{MANIFEST}"):
        fs.rm(f"{root}/{MANIFEST}")  # un-commit the old copy before overwriting it
    with progress() as bar:
        task = bar.add_task(f"upload → {uri}", total=sum(v["size"] for v in manifest.values()))
        for rel in sorted(manifest):
            with (src / rel).open("rb") as fi, fs.open(f"{root}/{rel}", "wb") as fo:
                while chunk := fi.read(CHUNK):
                    fo.write(chunk)
                    bar.advance(task, len(chunk))
    for rel, meta in sorted(manifest.items()):
        h = hashlib.sha256()
        with _open_read(fs, f"{root}/{rel}") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
        if h.hexdigest() != meta["sha256"]:
            raise OSError(f"checksum mismatch after upload of {rel} to {uri}")
    with fs.open(f"{root}/{MANIFEST}", "w") as fh:
        fh.write(json.dumps(manifest, indent=1, sort_keys=True))
    return uri


def _open_read(fs: Any, path: str) -> Any:
    """Open a store file for one sequential read (HTTP stores stream: no range requests needed)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if {"http", "https"} & set(protocols):
        return fs.open(path, "rb", block_size=0)
    return fs.open(path, "rb")


def verify(root: Path, manifest: dict[str, dict[str, Any]], label: str) -> None:
    """Raise OSError unless root holds exactly the manifest's files with their sha256."""
    got = manifest_of(root, label)
    if got != manifest:
        bad = sorted(k for k in set(got) | set(manifest) if got.get(k) != manifest.get(k))
        raise OSError(f"{label} at {root} does not match its manifest: {bad}")


def replace_dir(new: Path, dst: Path) -> None:
    """Rename `new` to `dst`; an existing dst is moved aside first and removed after."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
        dst.rename(old)
    new.rename(dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(uri: str) -> dict[str, dict[str, Any]] | None:
    """The MANIFEST.json of a staged copy, or None when the copy is missing or incomplete."""
    try:
        if is_local_uri(uri):
            return json.loads((local_path(uri) / MANIFEST).read_text())
        fs, root = fsspec.core.url_to_fs(uri)
        with _open_read(fs, f"{root}/{MANIFEST}") as fh:
            return json.loads(fh.read())
    except (OSError, json.JSONDecodeError, FileNotFoundError):
        return None


def fetch_from_store(uri: str, local_dir: Path, verify_checksums: bool = True) -> Path:
    """Make `local_dir` a verified copy of the staged weights at `uri` (the node-local cache fill).

    A complete local copy (same MANIFEST.json) is reused as is; otherwise it is downloaded into a hidden
    sibling, checked against the manifest and renamed into place.
    """
    manifest = read_manifest(uri)
    if manifest is None:
        raise FileNotFoundError(f"{uri} holds no {MANIFEST}: not staged, or staging did not finish")
    local_manifest = local_dir / MANIFEST
    if local_manifest.is_file() and json.loads(local_manifest.read_text()) == manifest:
        return local_dir
    tmp = local_dir.with_name(f".{local_dir.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        if is_local_uri(uri):
            copy_tree_local(local_path(uri), tmp, f"fetch {uri}")
        else:
            fs, root = fsspec.core.url_to_fs(uri)
            with progress() as bar:
                task = bar.add_task(f"fetch {uri}", total=sum(v["size"] for v in manifest.values()))
                for rel in sorted(manifest):
                    out = tmp / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with _open_read(fs, f"{root}/{rel}") as fi, out.open("wb") as fo:
                        while chunk := fi.read(CHUNK):
                            fo.write(chunk)
                            bar.advance(task, len(chunk))
        (tmp / MANIFEST).unlink(missing_ok=True)
        if verify_checksums:
            verify(tmp, manifest, "fetched copy")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        replace_dir(tmp, local_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local_dir
