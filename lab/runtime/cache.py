"""On-disk cache of built artifacts (ONNX exports, ONNX Runtime optimized models, TensorRT engines).

Write-up 001 files engines as `{model}_{arch}_{precision}_b{batch}.engine` and rebuilds when the
GPU changes, because an engine holds SASS for one architecture. We keep that name and add what
else makes a built file wrong to reuse:

    key  = model, arch (sm_XX or 'cpu'), precision, batch, input shapes, a hash of the exported
           graph (the ONNX bytes) or of the module's weights, backend + version, build options
    file = {model}_{arch}_{precision}_b{batch}_{hash8}.{ext}    hash8 = sha256(key)[:8]
    side = file + '.json': the full key, sha256 and size of the artifact (and of its companion
           files, e.g. ONNX external data)

Entries for several GPUs and versions live side by side in one folder (a shared volume). Nothing
is loaded blindly: `lookup` checks the sidecar key, the artifact's sha256, then asks the caller to
deserialize it; any failure warns with the reason and returns None so the caller rebuilds, and
`store` replaces the bad entry. A cache folder carried to another GPU, or used with another
onnxruntime/TensorRT version, holds no entry under the new key; `lookup` then says which
neighbouring entry it found and why it is not usable. Writes are atomic (temp file + fsync +
rename), artifact first and sidecar last, so a crash mid-store leaves an entry without sidecar,
which reads as invalid.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from lab.results import atomic_write_bytes, atomic_write_text

# fields that name an entry; the others are compared when explaining a miss
NAME_FIELDS = ("model", "arch", "precision", "batch")
# a miss caused by one of these is the "moved to another GPU / upgraded a library" case
EXPLAIN_FIELDS = ("arch", "backend_version", "graph_sha256", "module_sha256", "input_shapes", "options")
_CHUNK = 1 << 24


class CacheWarning(UserWarning):
    """A cache entry exists but cannot be used (other arch/version, corrupt); it is rebuilt."""


def target_arch(device: torch.device | str) -> str:
    """The hardware an artifact is built for: the GPU's 'sm_XX' for CUDA work, 'cpu' otherwise.

    A CPU module on a GPU machine gets 'cpu': its ONNX Runtime CPU artifact does not depend on the GPU.
    """
    from lab import env

    return env.arch_tag() if torch.device(device).type == "cuda" else "cpu"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", str(text)).strip("-") or "x"


def key_hash(key: dict[str, Any]) -> str:
    """sha256 of the key's canonical JSON (sorted keys), hex."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def make_key(model: str, arch: str, precision: str, batch: int, input_shapes: Iterable[Iterable[int]],
             backend: str, backend_version: str, **extra: Any) -> dict[str, Any]:
    """The full cache key. `extra` carries graph_sha256 / module_sha256 / options."""
    key = {"model": str(model), "arch": str(arch), "precision": str(precision), "batch": int(batch),
           "input_shapes": [list(map(int, s)) for s in input_shapes], "backend": str(backend),
           "backend_version": str(backend_version)}
    key.update(extra)
    return json.loads(json.dumps(key, sort_keys=True, default=str))  # normalized: tuples → lists


def entry_name(key: dict[str, Any], ext: str) -> str:
    """'{model}_{arch}_{precision}_b{batch}_{hash8}.{ext}'."""
    return (f"{_slug(key['model'])}_{_slug(key['arch'])}_{_slug(key['precision'])}_b{int(key['batch'])}"
            f"_{key_hash(key)[:8]}.{ext.lstrip('.')}")


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_sidecar(path: str | Path) -> dict[str, Any] | None:
    """The sidecar of an artifact (or the sidecar file itself), or None when missing/unreadable."""
    p = Path(path)
    side = p if p.name.endswith(".json") else _sidecar(p)
    try:
        return json.loads(side.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def validate(path: str | Path, key: dict[str, Any]) -> str | None:
    """Why the entry at `path` must not be used for `key`, or None when its files check out.

    Checks: sidecar present and readable, its key equal to `key` field by field, every file
    present with the recorded size and sha256. Deserializing is the caller's last check.
    """
    path = Path(path)
    meta = read_sidecar(path)
    if meta is None:
        return f"{path.name}: sidecar {path.name}.json missing or unreadable (interrupted write?)"
    diff = describe_diff(meta.get("key", {}), key)
    if diff:
        return f"{path.name}: built for {diff}"
    for name, rec in meta.get("files", {}).items():
        f = path.parent / name
        if not f.is_file():
            return f"{path.name}: file {name} is missing"
        size = f.stat().st_size
        if size != rec.get("bytes"):
            return f"{path.name}: {name} is {size} bytes, the sidecar recorded {rec.get('bytes')} (truncated or replaced)"
        if sha256_file(f) != rec.get("sha256"):
            return f"{path.name}: sha256 of {name} does not match the sidecar (corrupt or replaced)"
    return None


def describe_diff(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """'arch=sm_86 (this run: sm_90), backend_version=…': the fields where two keys differ."""
    out = []
    for k in sorted(set(theirs) | set(ours)):
        if theirs.get(k) != ours.get(k):
            a, b = theirs.get(k), ours.get(k)
            if k.endswith("sha256") and isinstance(a, str) and isinstance(b, str):
                a, b = a[:12], b[:12]
            out.append(f"{k}={a} (this run: {b})")
    return ", ".join(out)


def neighbours(cache_dir: str | Path, key: dict[str, Any], ext: str) -> list[tuple[Path, str]]:
    """Entries of the same model/precision/batch/backend under another key, with what differs."""
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        return []
    out = []
    for side in sorted(cache_dir.glob(f"{_slug(key['model'])}_*_b{int(key['batch'])}_*.{ext.lstrip('.')}.json")):
        meta = read_sidecar(side)
        if not meta:
            continue
        k = meta.get("key", {})
        if any(k.get(f) != key.get(f) for f in ("model", "precision", "batch", "backend")):
            continue
        diff = describe_diff(k, key)
        if diff:
            out.append((side.with_name(side.name[:-len(".json")]), diff))
    return out


def lookup(cache_dir: str | Path | None, key: dict[str, Any], ext: str,
           load: Callable[[Path], Any] | None = None) -> tuple[Path | None, Any]:
    """(path, loaded) of a valid entry, or (None, None) after warning why nothing was usable.

    `load(path)` deserializes the artifact (e.g. creates the runtime session); an exception or a
    None result counts as a corrupt entry. Never raises for a bad entry: it warns and misses.
    """
    if cache_dir is None:
        return None, None
    path = Path(cache_dir) / entry_name(key, ext)
    if not path.exists():
        others = neighbours(cache_dir, key, ext)
        if others:  # one warning naming every entry that looked reusable and why it is not
            why = "; ".join(f"{o.name} was built for {diff}" for o, diff in others)
            warnings.warn(f"engine cache: not usable here: {why}; building a new entry {path.name}",
                          CacheWarning, stacklevel=2)
        return None, None
    reason = validate(path, key)
    if reason is None and load is not None:
        try:
            loaded = load(path)
            if loaded is None:
                reason = f"{path.name}: failed to deserialize (the runtime returned nothing)"
            else:
                return path, loaded
        except Exception as e:  # any deserializer error means: do not trust this file
            reason = f"{path.name}: failed to deserialize ({type(e).__name__}: {str(e)[:200]})"
    if reason is None:
        return path, None
    warnings.warn(f"engine cache: {reason}; rebuilding", CacheWarning, stacklevel=2)
    return None, None


def store(cache_dir: str | Path, key: dict[str, Any], ext: str, src: str | Path | bytes,
          companions: Iterable[str | Path] = ()) -> Path:
    """Copy (or write) an artifact into the cache under `key`, atomically, with its sidecar.

    `src`: bytes or a file to copy. `companions`: files that must sit next to it under the same
    name they have now (ONNX external data: the .onnx file refers to it by name).
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / entry_name(key, ext)
    side = _sidecar(path)
    if side.exists():  # replacing an invalid entry: drop the sidecar first so a crash leaves it invalid
        side.unlink()
    files = {}
    data = src if isinstance(src, (bytes, bytearray, memoryview)) else None
    if data is not None:
        atomic_write_bytes(path, bytes(data), overwrite=True)
    else:
        _atomic_copy(Path(src), path)
    files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    for c in companions:
        c = Path(c)
        dst = cache_dir / c.name
        if c.resolve() != dst.resolve():
            _atomic_copy(c, dst)
        files[dst.name] = {"bytes": dst.stat().st_size, "sha256": sha256_file(dst)}
    meta = {"key": key, "files": files, "artifact": path.name,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_text(side, json.dumps(meta, indent=2, sort_keys=True), overwrite=True)
    return path


def _atomic_copy(src: Path, dst: Path) -> None:
    """Copy without holding the whole file in memory (engines and ONNX data reach GBs)."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, _CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def listing(cache_dir: str | Path) -> list[dict[str, Any]]:
    """One row per entry: file, MB, arch, precision, batch, kind + version, created, valid."""
    rows = []
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        return rows
    for side in sorted(cache_dir.glob("*.json")):
        meta = read_sidecar(side)
        if not meta or "key" not in meta:
            continue
        k = meta["key"]
        art = cache_dir / meta.get("artifact", side.name[:-5])
        size = sum(r.get("bytes", 0) for r in meta.get("files", {}).values())
        rows.append({"file": art.name, "MB": round(size / 2**20, 2), "arch": k.get("arch"),
                     "precision": k.get("precision"), "batch": k.get("batch"), "kind": k.get("backend"),
                     "version": k.get("backend_version"),
                     "created_utc": meta.get("created_utc"), "valid": validate(art, k) is None})
    return rows
