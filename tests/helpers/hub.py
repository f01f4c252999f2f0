"""A Hugging Face cache in a folder, and the Hub's network replaced by a copy from a local folder.

``cache_snapshot`` lays files out as a download leaves them (``models--org--name/refs/<revision>``,
``snapshots/<commit>/...``). ``FakeHub`` stands in for ``huggingface_hub.snapshot_download``: it
records each call, "downloads" (copies from the repository's folder into the cache) what an online
call would, and hands the call to the real ``snapshot_download`` offline, which resolves the folder
from the cache: only the network is replaced, never the resolution.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub.utils import filter_repo_objects

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_REAL = huggingface_hub.snapshot_download


def snapshot_path(cache: Path, repo_id: str, commit: str = COMMIT) -> Path:
    return Path(cache, f"models--{repo_id.replace('/', '--')}", "snapshots", commit)


def cache_snapshot(
    cache: Path, repo_id: str, files_of: Path, revision: str = "main", commit: str = COMMIT, patterns: Any = None
) -> Path:
    """``files_of``'s files matching ``patterns`` (all: None) as the snapshot ``commit`` of ``repo_id``, named by ``revision``."""
    snapshot = snapshot_path(cache, repo_id, commit)
    for name in filter_repo_objects(sorted(p.name for p in files_of.iterdir()), allow_patterns=patterns):
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy2(files_of / name, snapshot / name)
    refs = snapshot.parents[1] / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / revision).write_text(commit)
    return snapshot


class FakeHub:
    """``snapshot_download`` with the Hub's repositories at ``repos[repo_id]`` (folders). Each call's
    keyword arguments go to ``calls``, and to ``events`` as ``("download", patterns)`` (copied from
    the "Hub") or ``("cache", patterns)`` (resolved from the cache alone)."""

    def __init__(self, repos: dict[str, Path], events: list | None = None) -> None:
        self.repos, self.calls, self.events = repos, [], events if events is not None else []

    def __call__(self, repo_id: str, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        online = not kwargs.get("local_files_only") and not huggingface_hub.is_offline_mode()
        self.events.append(("download" if online else "cache", kwargs["allow_patterns"]))
        if online:
            if repo_id not in self.repos:
                raise OSError(f"404 Client Error: {repo_id} is not on the Hub")
            cache = Path(kwargs.get("cache_dir") or huggingface_hub.constants.HF_HUB_CACHE)
            cache_snapshot(cache, repo_id, self.repos[repo_id], kwargs.get("revision") or "main",
                           patterns=kwargs["allow_patterns"])  # fmt: skip
        return _REAL(repo_id, **{**kwargs, "local_files_only": True})

    @property
    def transfers(self) -> list[list[str]]:
        """The patterns of each call that went to the network."""
        return [patterns for kind, patterns in self.events if kind == "download"]
