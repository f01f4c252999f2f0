"""A Hub id ("org/name") streamed from its snapshot in the Hugging Face cache (``elixir_hf.loading.hub``):
the same weights as the repository's files, never a full load; the revision, cache folder and token
honoured; what is downloaded is what ``from_pretrained`` reads; local rank 0 downloads while the other
ranks wait (2 gloo ranks: in a process group; 2 torchrun ranks before one exists: on the launcher's
store); offline without the snapshot, one message naming the id, the command and the variable.

The cache is a folder of the test (``helpers.hub``); only the network is replaced (``FakeHub`` copies a
repository's folder into the cache where a download would), ``snapshot_download`` itself resolves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM

import elixir_hf
from elixir_hf.loading import hub
from elixir_runtime.weights.attached import attached_weights
from helpers.dist import run_distributed
from helpers.hub import FakeHub, cache_snapshot, snapshot_path
from helpers.models import ATTN_IMPL, tiny_llama

REPO = "org/tiny"
V1 = "fedcba9876543210fedcba9876543210fedcba98"
ROOT = Path(__file__).parents[3]


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    """The Hub's copies: ``org/tiny`` sharded (an index and its shards), its ``v1`` with other weights, and
    files ``from_pretrained`` does not read (the download must leave them)."""
    root = tmp_path_factory.mktemp("hub")
    tiny_llama(seed=5).save_pretrained(root / "main", max_shard_size="4KB")
    tiny_llama(seed=6).save_pretrained(root / "v1")
    for folder in (root / "main", root / "v1"):
        (folder / "consolidated.safetensors").write_bytes(b"not read")
        (folder / "README.md").write_text("a model card")
    return {REPO: root / "main", f"{REPO}@v1": root / "v1"}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """``HF_HUB_CACHE`` pointed at an empty folder, offline."""
    folder = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(folder))  # read once, at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return folder


def _load(name: str, **kwargs):
    return elixir_hf.from_pretrained(
        AutoModelForCausalLM, name, dtype=torch.float32, attn_implementation=ATTN_IMPL, **kwargs
    )


def _weights(model) -> dict[str, torch.Tensor]:
    """What the engine will read for each parameter: its whole range, from the files the model carries."""
    source = attached_weights(model)
    return {n: source.read(p, 0, p.numel(), torch.device("cpu")).view(p.shape) for n, p in model.named_parameters()}


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())


def _assert_streamed_from(model, snapshot: Path, folder: Path) -> None:
    assert all(p.is_meta for p in model.parameters())  # the stock load would have filled them
    assert attached_weights(model).origin == str(snapshot)
    want = _saved(folder)
    got = _weights(model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert model.config.name_or_path == REPO  # what PEFT records as the base model, not the cache folder


def test_a_cached_hub_id_streams_from_its_snapshot_offline(repos, cache, monkeypatch) -> None:
    main = cache_snapshot(cache, REPO, repos[REPO])
    v1 = cache_snapshot(cache, REPO, repos[f"{REPO}@v1"], revision="v1", commit=V1)
    fake = FakeHub(repos)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)

    _assert_streamed_from(_load(REPO), main, repos[REPO])
    _assert_streamed_from(_load(REPO, revision="v1"), v1, repos[f"{REPO}@v1"])
    assert fake.transfers == [] and all(kw["local_files_only"] for kw in fake.calls)  # no network


def test_online_only_what_from_pretrained_reads_is_downloaded(repos, cache, monkeypatch, tmp_path) -> None:
    """The config, generation config, the index, then the shards it names; revision, cache_dir and
    token reach huggingface_hub; the model card and an unread consolidated file stay on the Hub."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    fake = FakeHub({REPO: repos[REPO]})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    elsewhere = tmp_path / "cache-dir"

    model = _load(REPO, revision="main", cache_dir=str(elsewhere), token="hf_test")
    snapshot = snapshot_path(elsewhere, REPO)
    _assert_streamed_from(model, snapshot, repos[REPO])
    shards = sorted(set(json.loads((repos[REPO] / hub.INDEX_FILE).read_text())["weight_map"].values()))
    assert fake.transfers == [list(hub.FILES), shards]
    assert {(kw["revision"], kw["cache_dir"], kw["token"]) for kw in fake.calls} == {
        ("main", str(elsewhere), "hf_test")
    }
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        ["config.json", "generation_config.json", hub.INDEX_FILE, *shards]
    )
    assert not cache.exists()  # HF_HUB_CACHE untouched: cache_dir was given


@pytest.mark.parametrize("cached", ["nothing", "the config alone"])
def test_offline_without_the_snapshot_one_message_names_the_command(repos, cache, cached) -> None:
    if cached != "nothing":  # what an AutoConfig.from_pretrained of the id leaves
        cache_snapshot(cache, REPO, repos[REPO], patterns=["config.json"])
    with pytest.raises(hub.NotCachedError) as exc:  # a SystemExit: the message alone, no traceback
        _load(REPO, revision="main")
    message = str(exc.value.code)
    assert REPO in message and f"`hf download {REPO} --revision main`" in message and "HF_HUB_OFFLINE" in message
    assert str(cache) in message


def test_local_files_only_is_honoured_online(repos, cache, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    fake = FakeHub({REPO: repos[REPO]})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(hub.NotCachedError, match="local_files_only=True"):
        _load(REPO, local_files_only=True)
    assert fake.transfers == []


def test_the_cli_named_is_the_one_huggingface_hub_ships() -> None:
    from importlib.metadata import entry_points

    scripts = {e.name for e in entry_points(group="console_scripts") if e.value.startswith("huggingface_hub")}
    assert "hf" in scripts, scripts


# --------------------------------------------------------------------------- download once


def _two_ranks(rank: int, world_size: int, repos: dict[str, Path], cache: str) -> dict:
    """Online, the cache empty: this rank's downloads, its barrier (is the snapshot in the cache when
    the barrier returns?) and its load, in the order they happened."""
    import torch.distributed as dist

    events: list = []
    fake = FakeHub(repos, events)
    huggingface_hub.constants.HF_HUB_CACHE, huggingface_hub.constants.HF_HUB_OFFLINE = cache, False
    huggingface_hub.snapshot_download = fake
    os.environ["LOCAL_RANK"] = str(rank)  # one host
    gather = dist.all_gather_object

    def barrier(out, obj, *args, **kwargs):
        gather(out, obj, *args, **kwargs)
        events.append(("barrier", snapshot_path(Path(cache), REPO).joinpath(hub.INDEX_FILE).is_file()))

    dist.all_gather_object = barrier
    model = _load(REPO)
    events.append(("loaded", attached_weights(model).origin))
    return {"events": events, "weights": _weights(model)}


def test_two_ranks_in_a_process_group_download_once(repos, tmp_path) -> None:
    """Rank 0 downloads, then the barrier, then both load from the same snapshot; rank 1 only reads
    the cache, after the barrier (the cache was empty: it could not have loaded before)."""
    cache = tmp_path / "hf-cache"
    ranks = run_distributed(_two_ranks, 2, repos, str(cache))
    snapshot = snapshot_path(cache, REPO)
    shards = sorted(set(json.loads((repos[REPO] / hub.INDEX_FILE).read_text())["weight_map"].values()))
    loaded = ("loaded", str(snapshot))
    assert ranks[0]["events"] == [("download", list(hub.FILES)), ("download", shards), ("barrier", True), loaded]
    assert ranks[1]["events"] == [("barrier", True), ("cache", list(hub.FILES)), ("cache", shards), loaded]
    want = _saved(repos[REPO])
    for r in ranks:
        assert all(torch.equal(r["weights"][k], want[k]) for k in want)


@pytest.mark.once  # the wait on torchrun's store; the 2-rank gloo test runs the loading on both versions
def test_two_torchrun_ranks_before_a_process_group_wait_on_the_launchers_store(repos, tmp_path) -> None:
    """A script that loads its model before anything builds a process group (``hub_worker.py``): rank 1
    waits on torchrun's store for local rank 0's download, then reads the cache alone."""
    cache, out = tmp_path / "hf-cache", tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    worker = Path(__file__).with_name("hub_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]
    proc = subprocess.run([*cmd, str(repos[REPO]), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    shards = sorted(set(json.loads((repos[REPO] / hub.INDEX_FILE).read_text())["weight_map"].values()))
    loaded = ["loaded", str(snapshot_path(cache, REPO)), False]  # no process group was built
    assert ranks[0] == [["download", list(hub.FILES)], ["download", shards], ["waited", True], loaded]
    assert ranks[1] == [["waited", True], ["cache", list(hub.FILES)], ["cache", shards], loaded]


def _failing_download(rank: int, world_size: int, cache: str) -> str:
    from elixir_hf import launch

    launch.QUIET_RANK_WAIT_S = 0  # the launcher would end this rank once rank 0 has said it
    huggingface_hub.constants.HF_HUB_CACHE, huggingface_hub.constants.HF_HUB_OFFLINE = cache, False
    huggingface_hub.snapshot_download = FakeHub({})
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        _load(REPO)
    except OSError as e:
        return f"raised {e}"
    except SystemExit as e:
        return f"exit {e.code}"
    return "loaded"


def test_a_download_failing_on_rank_0_ends_every_rank(tmp_path) -> None:
    """Rank 1 does not wait forever for a download that failed: rank 0 raises the error, rank 1 ends
    without repeating it."""
    ranks = run_distributed(_failing_download, 2, str(tmp_path / "hf-cache"))
    assert ranks == [f"raised 404 Client Error: {REPO} is not on the Hub", "exit 1"]
