"""A Hub id ("org/model") as the snapshot folder of the Hugging Face cache, downloaded once per host.

``snapshot_folder`` gets, through ``huggingface_hub.snapshot_download``, what ``from_pretrained``
reads (the config, the generation config, ``model.safetensors`` or the index and the shards it
names; with ``trust_remote_code`` the repository's ``*.py``), honouring ``revision``,
``cache_dir``, ``token``, ``force_download``, ``local_files_only`` and ``HF_HUB_OFFLINE``. The
folder is then streamed as any local folder (``stream.py``).

[Note: download once]
Local rank 0 of each host downloads into that host's cache (``HF_HUB_CACHE``, or ``cache_dir``);
every other rank waits for it, then finds the snapshot in the cache without the network. One rule
for per-host and shared caches: hosts sharing a cache download at the same time, and
huggingface_hub's lock per file keeps that to one transfer of each file. The ranks wait in
``all_gather_object`` when a process group exists (bounded by its timeout: the Trainer's
``--ddp_timeout``, 30 minutes by default), else on the store of the launcher (torchrun's agent,
which ``accelerate launch`` starts too); where there is neither, every process resolves the id
itself and the same locks keep the download to one. A failed download fails every rank: the rank
that failed raises its error, rank 0 names it, the others leave the message to it (``launch.stop``).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import huggingface_hub
import torch.distributed as dist
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from elixir_runtime import INDEX_FILE, SINGLE_FILE

from ..launch import LaunchError, stop

__all__ = ["HUB_KWARGS", "NotCachedError", "is_hub_id", "snapshot_folder"]

HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download")
"""``from_pretrained`` arguments that locate a Hub id's files: used here, not by the load of the snapshot folder."""
FILES = ("config.json", "generation_config.json", SINGLE_FILE, INDEX_FILE, "adapter_config.json")
"""What ``from_pretrained`` of a safetensors checkpoint reads (a PEFT adapter's config: to tell it is
one, and load it without streaming); the shards an index names come after it."""
_LOADABLE = (SINGLE_FILE, INDEX_FILE, "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_config.json")
STORE_WAIT = timedelta(hours=24)
"""How long a rank waits on the launcher's store for its host's download (a crashed download ends the job first)."""

_calls = itertools.count()
"""Resolutions so far in this process: every rank resolves the same ids in the same order (store keys)."""


class NotCachedError(LaunchError):
    """The Hub id is not in the cache and cannot be downloaded; the message names the command that
    downloads it. A ``SystemExit``: uncaught, the message alone, status 1."""


def is_hub_id(name_or_path: str | os.PathLike[str]) -> bool:
    """Not a path that exists, and spelled as a Hub id: what transformers would look up on the Hub."""
    if Path(name_or_path).exists():
        return False
    try:
        validate_repo_id(str(name_or_path))
    except HFValidationError:
        return False
    return True


def snapshot_folder(repo_id: str, kwargs: dict[str, Any]) -> Path:
    """The folder of ``repo_id``'s snapshot in the cache, holding what ``from_pretrained(repo_id,
    **kwargs)`` reads; downloaded by local rank 0 of each host while the others wait (Note:
    download once). Not cached where it cannot be downloaded: ``NotCachedError``. A downloader's failure
    is raised there and said by rank 0; the other ranks end without a word (``launch.stop``)."""
    offline = huggingface_hub.is_offline_mode() or bool(kwargs.get("local_files_only"))
    wait = _waiter(next(_calls))
    downloader = wait is None or _local_rank() == 0
    folder = failure = None
    if downloader:
        try:
            folder = _fetch(repo_id, kwargs, local_files_only=offline)
        except (Exception, NotCachedError) as e:  # every failure reaches the waiting ranks before it is raised
            failure = e
    failed = [m for m in wait(_message(repo_id, failure) if failure else None, downloader) if m] if wait else []
    if failure is not None:
        raise failure
    if failed:
        stop(failed[0], every_rank_says_it=True)
    return folder if folder is not None else _fetch(repo_id, kwargs, local_files_only=True)


def _fetch(repo_id: str, kwargs: dict[str, Any], local_files_only: bool) -> Path:
    sub = kwargs.get("subfolder") or ""

    def download(names: Iterable[str]) -> Path:  # names: paths in the subfolder
        return Path(
            huggingface_hub.snapshot_download(
                repo_id,
                allow_patterns=[f"{sub}/{n}" if sub else n for n in names],
                revision=kwargs.get("revision"),
                cache_dir=kwargs.get("cache_dir"),
                token=kwargs.get("token"),
                local_files_only=local_files_only,
                force_download=bool(kwargs.get("force_download")) and not local_files_only,
            )
        )

    files = (*FILES, "*.py") if kwargs.get("trust_remote_code") else FILES
    try:
        folder = download(files)
        index = folder / sub / INDEX_FILE
        if index.is_file():
            download(sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())))
        if local_files_only and not any((folder / sub / name).is_file() for name in _LOADABLE):
            raise LocalEntryNotFoundError(f"{folder / sub} holds a config but no weights")  # a config fetched alone
    except LocalEntryNotFoundError as e:
        raise NotCachedError(_not_cached(repo_id, kwargs, e)) from None
    return folder


def _not_cached(repo_id: str, kwargs: dict[str, Any], error: Exception) -> str:
    cache = kwargs.get("cache_dir")
    command = " ".join(
        [
            f"hf download {repo_id}",
            *([f"--revision {kwargs['revision']}"] if kwargs.get("revision") else []),
            *([f"--cache-dir {cache}"] if cache else []),
        ]
    )
    if huggingface_hub.is_offline_mode():
        why, fix = "downloads are off (HF_HUB_OFFLINE=1)", "or run with HF_HUB_OFFLINE unset"
    elif kwargs.get("local_files_only"):
        why, fix = "from_pretrained was given local_files_only=True", "or leave local_files_only out"
    else:
        why, fix = f"the Hub cannot be reached ({error})", "or run where the Hub can be reached"
    return (
        f"elixir-hf: {repo_id} is not a local folder and not (wholly) in the Hugging Face cache "
        f"({cache or huggingface_hub.constants.HF_HUB_CACHE}), and {why}. Download it into the cache first: "
        f"`{command}`, {fix}: local rank 0 of each host then downloads it."
    )


def _message(repo_id: str, failure: BaseException) -> str:
    if isinstance(failure, SystemExit):
        return str(failure.code)
    return f"elixir-hf: {repo_id} could not be downloaded: {type(failure).__name__}: {failure}"


def _waiter(call: int) -> Callable[[str | None, bool], list[str | None]] | None:
    """``wait(my failure or None, downloader) -> every downloader's`` once they are done, or None where
    ranks cannot wait for each other (one process, or a launcher without a store)."""
    if dist.is_available() and dist.is_initialized():

        def gathered(message: str | None, downloader: bool) -> list[str | None]:
            out: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(out, message)
            return out

        return gathered
    env = os.environ
    if (
        int(env.get("WORLD_SIZE", "1")) == 1
        or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or "GROUP_RANK" not in env
    ):
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=STORE_WAIT)
    key = f"elixir_hf/hub/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{call}/{env['GROUP_RANK']}"

    def posted(message: str | None, downloader: bool) -> list[str | None]:
        if downloader:
            store.set(key, message or "")
        return [store.get(key).decode() or None]  # blocks until the host's downloader posted

    return posted


def _local_rank() -> int:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return int(os.environ.get("LOCAL_RANK", rank))
