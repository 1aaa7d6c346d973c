"""An AUTOMATIC1111-layout models directory: checkpoints, LoRAs, embeddings, VAEs and ControlNets by name.

Layout (A1111's `models/` folder; the root may also be the web UI folder that holds `models/`, whose
`embeddings/` then sits beside `models/` as in A1111)::

    <root>/Stable-diffusion/  single-file checkpoints (*.safetensors) and diffusers model folders (model_index.json),
                              also in sub-folders, named "sub/name.safetensors" and "sub/folder" as A1111 lists them
    <root>/Lora/              LoRA files (*.safetensors), named by file name without the extension
    <root>/embeddings/        textual-inversion embeddings (*.safetensors, *.pt, *.bin), named by file name stem
    <root>/VAE/               VAE files (*.safetensors) and diffusers VAE folders (config.json)
    <root>/ControlNet/        ControlNet files (.safetensors, original or diffusers layout) and diffusers folders

A root without `Stable-diffusion/` is read the way `sdjax serve --models-dir` always read it: a folder that directly
holds diffusers model folders (the checkpoints), with no LoRA, embedding, VAE or ControlNet folders.

Names: a checkpoint answers to its A1111 title ("sub/name.safetensors [0123456789]"), its name with or without the
extension, its `model_name` ("sub_name") and its short hash; a LoRA, embedding or VAE to its file name with or
without the extension. A name is only ever looked up among the listed entries, so it cannot reach outside the
directory: names with "..", absolute paths, and entries that are symlinks pointing outside their kind's folder are
refused with a `ValueError` naming the name (a kind's folder may itself be a link: that is the owner's choice).
An unknown name raises `LookupError` listing close matches (or what exists). Listings are cached until `refresh()`
(A1111's refresh endpoints); a lookup that misses rescans once.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import threading
from pathlib import Path

# kind -> (folder name in the A1111 layout, file extensions, marker file of a folder entry or None)
KINDS: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    "checkpoint": ("Stable-diffusion", (".safetensors",), "model_index.json"),
    "lora": ("Lora", (".safetensors",), None),
    "embedding": ("embeddings", (".safetensors", ".pt", ".bin"), None),
    "vae": ("VAE", (".safetensors",), "config.json"),
    "controlnet": ("ControlNet", (".safetensors",), "config.json"),
}
_LABELS = {"checkpoint": "model", "lora": "LoRA", "embedding": "embedding", "vae": "VAE", "controlnet": "ControlNet"}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model file or folder of the directory. `name` is its path below its kind's folder, with "/"."""

    kind: str
    name: str
    path: Path

    @property
    def is_folder(self) -> bool:
        return self.path.is_dir()

    @property
    def stem(self) -> str:
        """The name without the file extension ("sub/name")."""
        return self.name if self.is_folder else self.name[: -len(Path(self.name).suffix) or None]

    @property
    def short_name(self) -> str:
        """The file name without extension (A1111's `name_for_extra`: what `<lora:...>` and infotext use)."""
        return self.stem.rsplit("/", 1)[-1]

    @property
    def model_name(self) -> str:
        """A1111's `model_name`: the stem with "/" as "_"."""
        return self.stem.replace("/", "_")


class HashCache:
    """SHA-256 of files (A1111's checkpoint hash; its short hash is the first 10 hex digits), keyed by path, size and
    modification time, so that a replaced file is hashed again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._known: dict[tuple, str] = {}

    @staticmethod
    def _key(path: Path) -> tuple[str, int, int]:
        st = path.stat()
        return (str(path.resolve()), st.st_size, st.st_mtime_ns)

    def sha256(self, path: str | os.PathLike) -> str:
        """The file's SHA-256 (read once, then cached)."""
        key = self._key(Path(path))
        with self._lock:
            if key in self._known:
                return self._known[key]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        with self._lock:
            self._known[key] = h.hexdigest()
        return self._known[key]

    def network_hash(self, path: str | os.PathLike) -> str:
        """A1111's hash of a LoRA file (its "addnet" hash: the SHA-256 of a .safetensors file's bytes after the
        header, so that editing the metadata keeps it); A1111 writes the first 12 hex digits as `Lora hashes`."""
        key = ("network", *self._key(Path(path)))
        with self._lock:
            if key in self._known:
                return self._known[key]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            header = f.read(8)
            if str(path).endswith(".safetensors") and len(header) == 8:
                f.seek(8 + int.from_bytes(header, "little"))
            else:
                f.seek(0)
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        with self._lock:
            self._known[key] = h.hexdigest()
        return self._known[key]

    def known(self, path: str | os.PathLike) -> str | None:
        """The SHA-256 if computed already (listings never read whole checkpoints), else None."""
        try:
            key = self._key(Path(path))
        except OSError:
            return None
        with self._lock:
            return self._known.get(key)


class ModelsDir:
    """The models directory at `root` (see the module docstring). Thread-safe; listings cached until `refresh`."""

    def __init__(self, root: str | os.PathLike):
        root = Path(root).expanduser()
        if not root.is_dir():
            raise ValueError(f"models directory {str(root)!r} is not a folder")
        if not (root / "Stable-diffusion").is_dir() and (root / "models" / "Stable-diffusion").is_dir():
            root = root / "models"  # the web UI's own folder
        self.root = root.resolve()
        self.a1111 = (self.root / "Stable-diffusion").is_dir()
        self._lock = threading.Lock()
        self._cache: dict[str, list[Entry]] = {}
        self.hashes = HashCache()

    def folder(self, kind: str) -> Path | None:
        """The folder of `kind`'s entries, or None when the directory has none."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {sorted(KINDS)}")
        if not self.a1111:
            return self.root if kind == "checkpoint" else None
        folder = self.root / KINDS[kind][0]
        beside = self.root.parent / "embeddings"
        if not folder.is_dir() and kind == "embedding" and self.root.name == "models" and beside.is_dir():
            folder = beside  # A1111 keeps embeddings beside models/, not in it
        return folder if folder.is_dir() else None

    def refresh(self, kind: str | None = None) -> None:
        """Forget the cached listing of `kind` (None: all kinds); the next listing rescans."""
        with self._lock:
            if kind is None:
                self._cache.clear()
            else:
                self._cache.pop(kind, None)

    def list(self, kind: str) -> list[Entry]:
        """The entries of `kind`, sorted by name (cached)."""
        with self._lock:
            if kind not in self._cache:
                self._cache[kind] = self._scan(kind)
            return list(self._cache[kind])

    def resolve(self, kind: str, name: str) -> Entry:
        """The entry `name` names. Raises ValueError for a name that would leave the directory, LookupError (listing
        close matches) for an unknown one."""
        label = _LABELS.get(kind, kind)
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{label} name {name!r} must be a non-empty string")
        text = name.strip().replace("\\", "/")
        if text.startswith("/") or Path(text).is_absolute() or ".." in text.split("/") or "\x00" in text:
            raise ValueError(
                f"{label} name {name!r} is not a name inside the models directory (absolute paths and '..' are refused)"
            )
        folder = self.folder(kind)
        if folder is None:
            raise LookupError(f"no {label} {name!r}: the models directory {self.root} has no {KINDS[kind][0]}/ folder")
        entry = self._match(kind, text)
        if entry is None:
            self.refresh(kind)
            entry = self._match(kind, text)
        if entry is None:
            escaping = self._escaping(kind, text)
            if escaping:
                raise ValueError(f"{label} {name!r} is a link pointing outside the models directory; it is not served")
            names = self.names(kind)
            shown = {}  # what a user might have meant (the stem, or the file name alone) -> the name to show
            for e, n in zip(self.list(kind), names, strict=True):
                shown.setdefault(e.short_name.lower(), n)
                shown.setdefault(e.stem.lower(), n)
            close = difflib.get_close_matches(text.lower(), list(shown), n=5, cutoff=0.5)
            close = list(dict.fromkeys(shown[c] for c in close))
            hint = f"did you mean {close}?" if close else f"available: {names[:50]}" if names else "none available"
            raise LookupError(f"no {label} {name!r} in {folder}; {hint}")
        return entry

    def names(self, kind: str) -> list[str]:
        """What a user would type for each entry: the name without extension for files of LoRAs and embeddings,
        the listed name otherwise."""
        if kind in ("lora", "embedding"):
            return [e.stem for e in self.list(kind)]
        return [e.name for e in self.list(kind)]

    def title(self, entry: Entry) -> str:
        """A1111's checkpoint title: "name [shorthash]" when the hash is known, else the name."""
        digest = None if entry.is_folder else self.hashes.known(entry.path)
        return f"{entry.name} [{digest[:10]}]" if digest else entry.name

    # ------------------------------------------------------------------ internals
    def _match(self, kind: str, text: str) -> Entry | None:
        entries = self.list(kind)
        text = text.split(" [")[0] if text.endswith("]") and " [" in text else text  # "name [hash]"
        for accept in (
            lambda e: e.name == text,
            lambda e: e.stem == text,
            lambda e: kind == "checkpoint" and e.model_name == text,
            lambda e: kind != "checkpoint" and "/" not in text and text in (e.short_name, e.path.name),
            lambda e: e.name.lower() == text.lower() or e.stem.lower() == text.lower(),
        ):
            found = [e for e in entries if accept(e)]
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                raise LookupError(
                    f"{_LABELS[kind]} name {text!r} is ambiguous: {[e.name for e in found]}; give the full name"
                )
        if kind == "checkpoint" and len(text) == 10 and all(c in "0123456789abcdef" for c in text.lower()):
            found = [e for e in entries if not e.is_folder and (self.hashes.known(e.path) or "")[:10] == text.lower()]
            if len(found) == 1:
                return found[0]
        return None

    def _escaping(self, kind: str, text: str) -> bool:
        """Whether `text` names a link in the kind's folder that points outside the directory (not listed)."""
        folder = self.folder(kind)
        if folder is None:
            return False
        candidates = [folder / text, *(folder / (text + ext) for ext in KINDS[kind][1])]
        return any(os.path.lexists(c) and not _inside(c.resolve(), folder.resolve()) for c in candidates)

    def _scan(self, kind: str) -> list[Entry]:
        folder = self.folder(kind)
        if folder is None:
            return []
        _, extensions, marker = KINDS[kind]
        top = folder.resolve()  # entries must lie inside it (the kind's folder may itself be a link: the admin's)
        out: list[Entry] = []
        seen = {top}  # folders walked, resolved: a link back to one of them (a cycle) is not followed
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
            here = Path(dirpath)
            if not _inside(here.resolve(), top):
                dirnames.clear()
                continue
            keep = []
            for d in sorted(dirnames):
                if d.startswith("."):
                    continue
                sub = here / d
                real = sub.resolve()
                if not _inside(real, top) or real in seen:
                    continue
                seen.add(real)
                if marker is not None and (sub / marker).is_file():
                    out.append(Entry(kind, _relative(sub, folder), sub))
                    continue  # a model folder: not searched for more models
                if not self.a1111 and kind == "checkpoint":
                    continue  # the flat layout: model folders directly in the root only
                keep.append(d)
            dirnames[:] = keep
            if not self.a1111:
                continue
            for f in sorted(filenames):
                path = here / f
                if f.startswith(".") or not extensions or not f.lower().endswith(extensions):
                    continue
                if not path.is_file() or not _inside(path.resolve(), top):
                    continue
                if kind == "checkpoint" and f.lower().endswith(".vae.safetensors"):
                    continue
                out.append(Entry(kind, _relative(path, folder), path))
        return sorted(out, key=lambda e: e.name.lower())


def _relative(path: Path, folder: Path) -> str:
    return path.relative_to(folder).as_posix()


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False
