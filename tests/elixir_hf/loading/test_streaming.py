"""Weights streamed from a ``save_pretrained`` folder into the chunk shards (``elixir_hf.from_pretrained``,
``elixir_runtime.weights.stream``): every rank builds the model on meta and reads only its shards' elements,
yet the engine starts from, and trains to, exactly what ``from_pretrained`` + ``prepare`` give (bit for
bit, 1 and 2 gloo ranks; sharded and single-file checkpoints; tied and untied heads; fp32 weights read
into a bf16 model). No read is larger than a chunk shard and the ranks together read each weight once.
A bad checkpoint is refused before any training step, naming the file and the fix."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import elixir_hf
import elixir_runtime as er
from elixir_runtime.weights.attached import attached_weights
from helpers.dist import run_distributed
from helpers.models import ATTN_IMPL, make_batch, tiny_gpt2, tiny_llama

STEPS = 3
SHARD = "4KB"
"""save_pretrained's max_shard_size: a file per one or two tensors of the tiny models."""
CASES = {
    "llama-sharded": (tiny_llama, {}, SHARD),
    "llama-tied-sharded": (tiny_llama, {"tie": True}, SHARD),
    "gpt2-tied-one-file": (tiny_gpt2, {}, None),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("streamed")
    out = {}
    for name, (build, kwargs, shard) in CASES.items():
        build(seed=5, **kwargs).save_pretrained(root / name, **({"max_shard_size": shard} if shard else {}))
        out[name] = str(root / name)
    return out


def _config(world_size: int) -> er.ElixirConfig:
    # chunks of 2048 elements split in two shards: parameters span both ranks' shards; half of them offloaded
    return er.ElixirConfig(mode="static", device="cpu", chunk_size=2048, offload=0.5)


def _train(model, rank: int, world_size: int, reads: list[int] | None = None) -> dict:
    source = attached_weights(model)
    if reads is not None and source is not None:
        read = source.read
        source.read = lambda p, start, numel, *rest: reads.append(numel) or read(p, start, numel, *rest)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)
    batch = lambda step: {k: v[rank::world_size] for k, v in make_batch(128, 2 * world_size, 16, seed=step).items()}  # noqa: E731
    model, opt = er.prepare(model, opt, _config(world_size), batch(0))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    losses = []
    for step in range(STEPS):
        loss = model(**batch(step)).loss
        opt.backward(loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    layout = model._elixir.live.layout
    return {
        "start": start,
        "losses": losses,
        "end": model.state_dict(),
        "largest_shard": max(layout.shard_numel(c) for c in layout.chunks),
    }


def _load(folder: str, stream: bool, dtype: torch.dtype = torch.float32):
    kwargs = dict(dtype=dtype, attn_implementation=ATTN_IMPL)
    if stream:
        return elixir_hf.from_pretrained(AutoModelForCausalLM, folder, **kwargs)
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def _assert_same(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    for what in ("start", "end"):
        assert got[what].keys() == want[what].keys()
        for k in want[what]:
            assert got[what][k].dtype == want[what][k].dtype and torch.equal(got[what][k], want[what][k]), (what, k)


def _both_ways(rank: int, world_size: int, folders: list[str]) -> list[tuple[dict, dict, list[int]]]:
    out = []
    for folder in folders:
        reads: list[int] = []
        streamed = _load(folder, stream=True)
        assert all(p.is_meta for p in streamed.parameters())
        out.append(
            (_train(streamed, rank, world_size, reads), _train(_load(folder, stream=False), rank, world_size), reads)
        )
    return out


def _numel(folder: str) -> int:
    model = _load(folder, stream=True)
    return sum(p.numel() for p in model.parameters())  # unique parameters: a tied pair counts once


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_streams_what_from_pretrained_loads(saved, case) -> None:
    [(streamed, loaded, reads)] = _both_ways(0, 1, [saved[case]])
    _assert_same(streamed, loaded)
    assert max(reads) <= streamed["largest_shard"] and sum(reads) == _numel(saved[case])


def test_fp32_checkpoint_into_a_bf16_model(saved) -> None:
    """Each slice is cast to the parameter's dtype as it is read, as from_pretrained casts the tensor."""
    folder = saved["llama-sharded"]
    streamed = _train(_load(folder, True, torch.bfloat16), 0, 1)
    _assert_same(streamed, _train(_load(folder, False, torch.bfloat16), 0, 1))
    assert streamed["start"]["lm_head.weight"].dtype == torch.bfloat16


def test_two_ranks_each_read_only_their_shards(saved) -> None:
    folders = list(saved.values())
    results = run_distributed(_both_ways, 2, folders)
    for i, folder in enumerate(folders):
        (s0, l0, reads0), (s1, l1, reads1) = results[0][i], results[1][i]
        _assert_same(s0, l0)
        _assert_same(s1, l1)
        total = _numel(folder)
        assert sum(reads0) + sum(reads1) == total  # every element read once, by one rank
        assert max(reads0 + reads1) <= s0["largest_shard"] < total // 2


def _fail_on_rank_1(rank: int, world_size: int, folder: str) -> str:
    model = _load(folder, stream=True)
    if rank == 1:
        attached_weights(model).read = lambda *a: (_ for _ in ()).throw(OSError("disk read error"))
    try:
        _train(model, rank, world_size)
    except RuntimeError as e:
        return str(e)
    return "trained"


def test_a_read_failing_on_one_rank_fails_prepare_on_every_rank(saved) -> None:
    messages = run_distributed(_fail_on_rank_1, 2, saved["gpt2-tied-one-file"])
    for message in messages:
        assert "reading the weights from" in message and "rank 1: OSError: disk read error" in message


# --------------------------------------------------------------------------- bad checkpoints


@pytest.fixture
def copy_of(saved, tmp_path):
    def copy(case: str) -> Path:
        return Path(shutil.copytree(saved[case], tmp_path / case))

    return copy


def test_shapes_that_do_not_match_the_config(copy_of) -> None:
    folder = copy_of("llama-sharded")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(
        er.WeightsError,
        match=r"size mismatch for model\.layers\.0\.mlp\.\w+_proj\.weight: .*"
        r"safetensors holds .* with shape \(\d+, \d+\), the model built from the config has",
    ):
        _load(str(folder), stream=True)


def _second_shard(folder: Path) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / sorted(set(index["weight_map"].values()))[1]


def test_a_shard_file_missing(copy_of) -> None:
    shard = _second_shard(copy_of("llama-sharded"))
    shard.unlink()
    with pytest.raises(er.WeightsError, match=rf"names 1 file\(s\) that are not in .*{shard.name}.*copy the whole"):
        _load(str(shard.parent), stream=True)


def test_a_truncated_shard_file(copy_of) -> None:
    shard = _second_shard(copy_of("llama-sharded"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(er.WeightsError, match=rf"{shard.name} cannot be read .*truncated"):
        _load(str(shard.parent), stream=True)


def test_a_missing_weight(copy_of) -> None:
    folder = copy_of("gpt2-tied-one-file")
    tensors = load_file(folder / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        er.WeightsError, match=r"1 parameters .* no tensor .*transformer\.h\.1\.mlp\.c_fc\.weight.*stream=False"
    ):
        _load(str(folder), stream=True)


def test_files_changed_after_loading_fail_prepare(copy_of) -> None:
    folder = copy_of("gpt2-tied-one-file")
    model = _load(str(folder), stream=True)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors changed size since the model was loaded"):
        _train(model, 0, 1)


def test_a_streamed_model_runs_only_under_the_engine(saved) -> None:
    model = _load(saved["gpt2-tied-one-file"], stream=True)
    with pytest.raises(RuntimeError, match=r"weights are still in .*stream=False"):
        model(**make_batch(128))


def test_a_bin_checkpoint_is_loaded_without_streaming(saved, tmp_path, caplog) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(Path(saved["gpt2-tied-one-file"]) / "config.json", folder)
    torch.save(load_file(Path(saved["gpt2-tied-one-file"]) / "model.safetensors"), folder / "pytorch_model.bin")
    with caplog.at_level(logging.WARNING, logger="elixir_hf.loading.model"):
        model = _load(str(folder), stream=True)
    assert not any(p.is_meta for p in model.parameters())  # one process: rank 0, which reads them
    assert "not streamed into the chunks" in caplog.text and "a .bin checkpoint" in caplog.text


def test_a_peft_adapter_loads_the_weights_as_without_streaming(saved, caplog) -> None:
    """PEFT places a new adapter where the base weight is (meta, for a streamed model): before it
    injects one, the model goes back to rank 0 reading its weights, loudly (Note: PEFT on a streamed model)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="elixir_hf.loading.stream"):
        streamed = get_peft_model(_load(saved["llama-sharded"], stream=True), lora)
    assert "a PEFT adapter is added" in caplog.text and attached_weights(streamed) is None
    torch.manual_seed(0)
    loaded = get_peft_model(_load(saved["llama-sharded"], stream=False), lora)
    assert not any(p.is_meta for p in streamed.parameters())
    _assert_same(_train(streamed, 0, 1), _train(loaded, 0, 1))
