"""The throughput harness's models, CLI and clipping: the published decoders (Llama-3-8B, Qwen2.5-7B, the
SFT recipes' models, ...) from their configs, any HF decoder config, ``--clip`` recorded and applied by
every system, DeepSpeed's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import _worker, report
from benchmarks.harness import MAX_GRAD_NORM
from benchmarks.models import (
    DecoderModel,
    Preset,
    build_meta,
    causal_lm,
    count_params,
    materialize,
    preset,
    restore_buffers_,
    vocab_size,
)
from benchmarks.systems import ds_config
from benchmarks.throughput import parse_args, worker_command
from helpers.dist import run_distributed

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def _config_file(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **fields}))
    return path


@pytest.mark.parametrize(
    "name, billions, fields",
    [
        (
            "llama3-8b",
            8_030_261_248,
            {
                "hidden_size": 4096,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "vocab_size": 128256,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5,
            },
        ),
        (
            "qwen2.5-7b",
            7_615_616_512,
            {
                "hidden_size": 3584,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "intermediate_size": 18944,
                "vocab_size": 152064,
                "rms_norm_eps": 1e-6,
            },
        ),
        (
            "llama2-13b",
            13_015_864_320,
            {"hidden_size": 5120, "num_hidden_layers": 40, "num_key_value_heads": 40, "intermediate_size": 13824},
        ),
        (
            "codellama-34b",
            33_744_232_448,
            {"hidden_size": 8192, "num_hidden_layers": 48, "num_key_value_heads": 8, "vocab_size": 32016},
        ),
        ("llama2-70b", 68_976_648_192, {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672}),
        # the SFT recipes' models (recipes/sft)
        (
            "llama3.1-8b",
            8_030_261_248,
            {"hidden_size": 4096, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072},
        ),
        (
            "qwen2.5-14b",
            14_770_033_664,
            {
                "hidden_size": 5120,
                "num_hidden_layers": 48,
                "num_attention_heads": 40,
                "num_key_value_heads": 8,
                "intermediate_size": 13824,
                "vocab_size": 152064,
            },
        ),
        (
            "mistral-7b-v0.3",
            7_248_023_552,
            {"hidden_size": 4096, "num_key_value_heads": 8, "vocab_size": 32768, "sliding_window": None},
        ),
    ],
)
def test_decoder_presets_are_the_published_models(name: str, billions: int, fields: dict) -> None:
    p = preset(name)
    assert isinstance(p, DecoderModel) and p.default_seq == 2048
    config = p.config(2048)
    assert {k: getattr(config, k) for k in fields} == fields
    assert config.tie_word_embeddings is False and config.use_cache is False
    theta = {"llama3-8b": 5e5, "llama3.1-8b": 5e5, "qwen2.5-7b": 1e6, "qwen2.5-14b": 1e6, "codellama-34b": 1e6}
    assert config.rope_parameters["rope_theta"] == theta.get(name, 1e6 if name.startswith("mistral") else 1e4)
    assert config.rope_parameters["rope_type"] == ("llama3" if name == "llama3.1-8b" else "default")
    model = build_meta(p, 2048, torch.bfloat16)
    assert count_params(model) == billions  # the published count, untied lm_head included
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.config._attn_implementation == "sdpa"
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # activation checkpointing
    q_bias = model.model.layers[0].self_attn.q_proj.bias
    assert (q_bias is not None) == name.startswith("qwen2.5")  # Qwen2.5's q/k/v biases
    assert vocab_size(p) == config.vocab_size


def test_parse_args_seq_follows_the_model_and_clip_is_on_by_default(tmp_path: Path) -> None:
    cfg = _config_file(tmp_path)
    args = parse_args(["--model", f"gpt2-4b,llama3-8b,{cfg}", "--batch-sizes", "8,4", "--gpus", "2"])
    assert args.seqs == {
        "gpt2-4b": 1024,
        "llama3-8b": 2048,
        str(cfg.resolve()): 128,
    }  # capped at the config's positions
    assert args.clip == 1 and args.batch_sizes == [4, 8]
    cmd = worker_command(args, "ds3_offload", "llama3-8b", [4])
    assert cmd[cmd.index("--seq") + 1] == "2048" and cmd[cmd.index("--clip") + 1] == "1"
    assert "--nproc_per_node=2" in cmd
    args = parse_args(["--model", "qwen2.5-7b", "--batch-sizes", "4", "--seq", "4096", "--clip", "0"])
    assert args.seqs == {"qwen2.5-7b": 4096} and args.clip == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "llama3-70b"], "unknown model 'llama3-70b'"),
        (["--model", "llama3-8b", "--seq", "16384"], "exceeds llama3-8b's max_position_embeddings (8192)"),
        (["--model", "llama3-8b", "--systems", "elixir,ds4_offload"], "unknown systems ['ds4_offload']"),
        (["--model", "llama3-8b", "--clip", "2"], "invalid choice"),
        (["--model", "llama3-8b", "--ds-ratio", "1.5"], "--ds-ratio 1.5: a share of the optimizer states in [0, 1]"),
    ],
)
def test_parse_args_rejects_bad_input_naming_it(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args([*argv, "--batch-sizes", "4"])
    assert message in capsys.readouterr().err


def test_model_folder_and_config_file_resolve_to_the_same_model(tmp_path: Path) -> None:
    cfg = _config_file(tmp_path)
    by_file, by_folder = preset(str(cfg)), preset(str(tmp_path))
    fields = [{k: v for k, v in m.hf_config.to_dict().items() if k != "_name_or_path"} for m in (by_file, by_folder)]
    assert isinstance(by_file, DecoderModel) and fields[0] == fields[1] and fields[0]["num_key_value_heads"] == 2
    h, ffn, v, layers = 64, 128, 512, 2
    per_layer = 4 * h * h // 2 + 2 * h * h // 2 + 3 * h * ffn + 2 * h  # q, o; k, v at 2 of 4 KV heads; MLP; 2 norms
    assert count_params(build_meta(by_file, 128)) == 2 * v * h + layers * per_layer + h  # untied: embed + lm_head
    tied = preset(str(_config_file(tmp_path, tie_word_embeddings=True)))
    assert count_params(build_meta(tied, 128)) == v * h + layers * per_layer + h
    assert isinstance(preset("6.5b"), Preset) and preset("6.5b").default_seq == 1024


def test_materialize_recomputes_the_rotary_buffers(tmp_path: Path) -> None:
    """``to_empty`` leaves Llama's ``inv_freq`` uninitialized (NaN losses under DeepSpeed): it is rebuilt."""
    p = preset(str(_config_file(tmp_path)))
    reference = dict(causal_lm(p.config(128)).named_buffers())  # built for real on the CPU
    model = materialize(build_meta(p, 128), "cpu", "cpu")
    assert set(dict(model.named_buffers())) == set(reference) and reference
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, reference[name], rtol=0, atol=0)
        b.fill_(float("nan"))  # what garbage memory may hold
    restore_buffers_(model)
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, reference[name], rtol=0, atol=0)
    restore_buffers_(model, "meta")  # FSDP2 + CPU offload: params on the CPU, buffers on the compute device
    assert all(b.is_meta for b in model.buffers()) and not any(q.is_meta for q in model.parameters())


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("clip", [True, False])
def test_deepspeed_config(stage: int, clip: bool) -> None:
    config = ds_config(stage, pin=True, clip=clip, micro_batch=4)
    zero = config["zero_optimization"]
    assert zero["stage"] == stage and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ("offload_param" in zero) == (stage == 3)
    if stage == 3:
        assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert config["gradient_clipping"] == (MAX_GRAD_NORM if clip else 0.0)
    assert config["bf16"] == {"enabled": True} and config["train_micro_batch_size_per_gpu"] == 4
    assert config["optimizer"]["type"] == "AdamW"
    assert (
        ds_config(stage, pin=False, clip=clip, micro_batch=4)["zero_optimization"]["offload_optimizer"]["pin_memory"]
        is False
    )


def test_deepspeed_partial_offload_keeps_the_parameters_on_the_gpu() -> None:
    """ZeRO-3 Twin-Flow: ``offload_optimizer.ratio`` of the optimizer states on the CPU, no parameter offload;
    the ratio reaches the worker."""
    zero = ds_config(3, pin=True, clip=True, micro_batch=4, ratio=0.55)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.55}
    assert "offload_param" not in zero
    args = parse_args(["--model", "qwen2.5-14b", "--batch-sizes", "4", "--systems", "ds3_partial", "--ds-ratio", "0.6"])
    cmd = worker_command(args, "ds3_partial", "qwen2.5-14b", [4])
    assert _worker.parse_args(cmd[cmd.index("benchmarks._worker") + 1 :]).ds_ratio == 0.6


def _clip_norms(rank: int, world: int, config_path: str) -> dict[str, list[float]]:
    """Each system's step on one tiny Llama, clip on (and plain with clip off): the norms each clip call saw."""
    from benchmarks.harness import Context
    from benchmarks.systems import build
    from elixir_runtime import ElixirOptimizer

    calls: dict[str, list[float]] = {}
    torch_clip, elixir_clip = torch.nn.utils.clip_grad_norm_, ElixirOptimizer.clip_grad_norm
    current = [""]

    def spy_torch(params, max_norm, *a, **k):
        assert max_norm == MAX_GRAD_NORM
        norm = torch_clip(params, max_norm, *a, **k)
        calls.setdefault(current[0], []).append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        return norm

    def spy_elixir(self, max_norm, *a, **k):
        assert max_norm == MAX_GRAD_NORM
        norm = elixir_clip(self, max_norm, *a, **k)
        calls.setdefault(current[0], []).append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_, ElixirOptimizer.clip_grad_norm = spy_torch, spy_elixir
    model = preset(config_path)
    ids = torch.randint(0, vocab_size(model), (2, 32), generator=torch.Generator().manual_seed(0))
    for system, clip in (("plain", True), ("fsdp2", True), ("elixir", True), ("plain-noclip", False)):
        current[0] = system
        ctx = Context(torch.device("cpu"), world, rank, seq=32, threads=1, clip=clip)
        trainer = build(system.removesuffix("-noclip"), model, ctx, ids)
        for _ in range(2):
            trainer.step(ids)
    return calls


def test_every_system_clips_the_same_norm_when_clip_is_on(tmp_path: Path) -> None:
    """Plain AMP, FSDP2 (DTensor grads) and Elixir each clip once per step, to 1.0, and see the same global
    norm of the same model and batch (bf16 compute: within 5 %); with clip off nothing is clipped."""
    (calls,) = run_distributed(_clip_norms, 1, str(_config_file(tmp_path)), timeout=240)
    assert set(calls) == {"plain", "fsdp2", "elixir"}, calls
    for system in ("plain", "fsdp2", "elixir"):
        assert len(calls[system]) == 2 and calls[system][0] > MAX_GRAD_NORM, calls  # the clip binds
        assert calls[system][0] == pytest.approx(calls["plain"][0], rel=0.05), calls


def test_report_keeps_clip_settings_apart_and_old_runs_read_as_unclipped(tmp_path: Path) -> None:
    base = {
        "model": "llama3-8b",
        "params": 8_030_261_248,
        "gpus": 1,
        "seq": 2048,
        "batch": 4,
        "status": "ok",
        "card": "NVIDIA H100 80GB HBM3",
        "gpu_total_GiB": 79.2,
    }
    runs = [
        dict(base, system="elixir", tflops=300.0, clip=True),
        dict(base, system="elixir", tflops=310.0),
        dict(base, system="fsdp2_offload", status="crashed", clip=True),
        dict(base, system="ds2_offload", status="error", error="build: RuntimeError: CPU Adam failed", clip=True),
    ]
    results = report.write(runs, tmp_path / "results.json")
    assert len(results["runs"]) == 4
    rows = {row["clip"]: row for row in results["offload_regime"]}
    assert rows[True]["tflops"] == {"elixir": 300.0, "fsdp2_offload": None, "ds2_offload": None}
    assert rows[True]["status"]["ds2_offload"] == "error" and rows[False]["tflops"] == {"elixir": 310.0}
    md = (tmp_path / "benchmarks.md").read_text()
    assert "| NVIDIA H100 80GB HBM3 | llama3-8b | 1 | 2048 | 4 | 1.0 | off | 300.0 | crashed | error |" in md
    assert "| NVIDIA H100 80GB HBM3 | llama3-8b | 1 | 2048 | 4 | off | off | 310.0 |" in md
    assert "CPU Adam failed" in md
