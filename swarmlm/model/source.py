"""Where a model's files come from: a local directory, or a hub id resolved the way transformers resolves it.

A hub id (`org/name`, optionally `org/name@revision`) is looked up in the local Hugging Face cache first
(`HF_HOME` / `HF_HUB_CACHE`, the layout `hub/models--org--name/snapshots/<commit>/...`); with `HF_HUB_OFFLINE=1`
nothing else is tried. Online, a missing file is downloaded on first use, one file at a time, so a process fetches
only what it reads: a server its config, tokenizer and the shards holding its blocks; a client the shards with
the embeddings, final norm and head (see TensorIndex in checkpoint.py).
"""
from __future__ import annotations

import difflib
import functools
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import _CACHED_NO_EXIST
from huggingface_hub.utils import validate_repo_id

# what AutoTokenizer / GenerationConfig may read; each is optional
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)


class ModelNotFound(FileNotFoundError):
    """The name is neither a checkpoint directory nor a model the hub (or its local cache) has."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # as the user gave it
    directory: Path | None = None  # a local checkpoint directory, or
    repo_id: str | None = None  # a hub id
    revision: str | None = None  # branch, tag or commit (None = main)
    gguf: Path | None = None  # or a GGUF file (model/gguf.py): config, tokenizer and weights all in it

    @property
    def is_hub(self) -> bool:
        return self.repo_id is not None

    def file(self, filename: str) -> Path:
        """A file of the checkpoint, downloaded if needed and allowed; FileNotFoundError if it has none."""
        path = self.optional_file(filename)
        if path is None and self.is_hub and constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"{self.name}: {filename} is not in the local HF cache ({constants.HF_HUB_CACHE}); "
                "set HF_HUB_OFFLINE=0 to download it"
            )
        if path is None:
            raise FileNotFoundError(f"{self.name} has no {filename}")
        return path

    def optional_file(self, filename: str) -> Path | None:
        if self.gguf is not None:
            return None  # a GGUF holds no separate files
        if self.directory is not None:
            path = self.directory / filename
            return path if path.is_file() else None
        return self._hub_file(filename)

    def is_local(self, filename: str) -> bool:
        """True if reading the file needs no download."""
        if self.gguf is not None:
            return True
        if self.directory is not None:
            return (self.directory / filename).is_file()
        return isinstance(try_to_load_from_cache(self.repo_id, filename, revision=self.revision), str)

    def snapshot_dir(self, files: tuple[str, ...] = ("config.json",) + TOKENIZER_FILES) -> Path:
        """A directory AutoConfig / AutoTokenizer can read, holding (at least) the given files when they exist."""
        if self.directory is not None:
            return self.directory
        found = [p for p in (self.optional_file(f) for f in files) if p is not None]
        return found[0].parent if found else self.file("config.json").parent

    def _hub_file(self, filename: str) -> Path | None:
        cached = try_to_load_from_cache(self.repo_id, filename, revision=self.revision)
        if isinstance(cached, str):
            return Path(cached)
        if cached is _CACHED_NO_EXIST:  # the hub said before that this file does not exist
            return None
        if constants.HF_HUB_OFFLINE:
            if filename == "config.json":  # nothing of this model is cached
                raise ModelNotFound(
                    f"{self.name}: not a directory, not a catalog model and not in the local HF cache "
                    f"({constants.HF_HUB_CACHE}); set HF_HUB_OFFLINE=0 to download it"
                )
            return None  # offline, an uncached optional file counts as absent (a required one fails in file())
        if not hub_reachable(constants.ENDPOINT):  # at once, not after huggingface_hub's retries
            raise ModelNotFound(f"{self.name}: not a directory and not in the local HF cache "
                                f"({constants.HF_HUB_CACHE}), and the hub ({constants.ENDPOINT}) cannot be reached")
        try:
            return Path(hf_hub_download(self.repo_id, filename, revision=self.revision))
        except RemoteEntryNotFoundError:  # the repo has no such file
            return None
        except GatedRepoError:
            raise ModelNotFound(f"{self.name} is gated on the hub: accept its terms and log in (HF_TOKEN)") from None
        except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
            raise ModelNotFound(f"{self.name}: not a directory and not a model on the hub ({exc})") from None
        except (LocalEntryNotFoundError, OSError) as exc:  # no network, hub down...
            raise ModelNotFound(
                f"{self.name}: not a directory, not in the local HF cache ({constants.HF_HUB_CACHE}) and the hub "
                f"could not be reached: {exc}"
            ) from None


def served_name(name_or_path: str | Path) -> str:
    """The model's name for the world (the API's model id, pages, logs others read): a catalog name or hub id as
    given, a checkpoint directory or GGUF file by its own name (never the path: it would show the user's home)."""
    from swarmlm.model.catalog import catalog_name_of

    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_file():
        return catalog_name_of(path) or (path.stem if path.suffix.lower() == ".gguf" else path.name)
    if path.is_dir() or name.startswith((".", "/", "~")):
        return path.resolve().name or name
    return name


def resolve(name_or_path: str | Path | ModelSource, revision: str | None = None) -> ModelSource:
    """A directory if one exists at that path, a GGUF file (`*.gguf`), a model of the catalog (model/catalog.py:
    its GGUF, fetched on first use), else a hub id (`org/name` or `org/name@revision`)."""
    from swarmlm.model.catalog import CATALOG, fetch

    if isinstance(name_or_path, ModelSource):
        return name_or_path
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSource(name, directory=path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(name, gguf=path)
    if name in CATALOG:
        return ModelSource(name, gguf=fetch(name))
    repo_id, _, at_revision = name.partition("@")
    if isinstance(name_or_path, Path) or name.startswith((".", "/", "~")) or path.exists():
        raise ModelNotFound(f"{name}: not a checkpoint directory nor a .gguf file")
    close = difflib.get_close_matches(repo_id, CATALOG, n=3, cutoff=0.6)
    if "/" not in repo_id and close:  # a typo of a catalog name, not one of the few hub ids without an org
        raise ModelNotFound(f"{name}: unknown model; did you mean {' or '.join(close)}?")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ModelNotFound(f"{name}: not a directory, not a catalog model ({', '.join(CATALOG)}) and not a hub "
                            "id (org/name)") from None
    return ModelSource(name, repo_id=repo_id, revision=revision or at_revision or None)


@functools.lru_cache(maxsize=4)
def hub_reachable(endpoint: str, timeout_s: float = 3.0) -> bool:
    """One TCP connection to the hub, asked once per process: offline, a hub id fails at once instead of after
    huggingface_hub's retries."""
    url = urlsplit(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
        return True
    except OSError:
        return False


def with_revision(name_or_path: str | Path, revision: str | None) -> str:
    """`org/name` + revision -> `org/name@revision` (how every loader takes a pinned hub id)."""
    name = str(name_or_path)
    if revision is None:
        return name
    if Path(name).expanduser().is_dir():
        raise ValueError(f"revision {revision!r} applies to hub ids, but {name} is a local directory")
    if "@" in name:
        raise ValueError(f"{name} already names a revision; revision={revision!r} too")
    return f"{name}@{revision}"


def gguf_in_snapshot(name_or_path: str | Path, gguf_file: str, revision: str | None = None) -> str:
    """The path of a GGUF file in a checkpoint directory or a hub id's snapshot (downloaded if allowed)."""
    if not gguf_file.lower().endswith(".gguf"):
        raise ValueError(f"gguf_file must name a .gguf file, got {gguf_file!r}")
    return str(resolve(with_revision(name_or_path, revision)).file(gguf_file))
