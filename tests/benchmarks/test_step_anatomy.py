"""benchmarks.step_anatomy on the CPU: every timed step's update is traced, and the phases add up."""

from __future__ import annotations

import json

from transformers import LlamaConfig

from benchmarks import step_anatomy


def test_tiny_model_with_offloaded_chunks(tmp_path, capsys):
    out = tmp_path / "anatomy.json"
    step_anatomy.main(
        ["--model", "tiny", "--batch-size", "2", "--seq", "64", "--steps", "2", "--offload", "0.5", "--threads", "2",
         "--device", "cpu", "--json", str(out)]
    )  # fmt: skip
    rec = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == rec
    assert len(rec["plan"]["offload"]) > 0 and len(rec["steps"]) == 2
    for s in rec["steps"]:
        # each timed step runs the previous step's update of every offloaded chunk, once
        assert s["cpu_elements"] == rec["alone_elements"] > 0 and s["device_lane_elements"] == 0
        assert 0 <= s["waits_s"] <= s["forward_s"] and s["forward_s"] + s["backward_s"] <= s["step_s"]
        assert s["cpu_Gps"] > 0
        # the engine's stall counters per step (on the CPU the loop's own time at acquires that wait):
        # each step's first forward acquire gathers, the step having dropped every gathered copy
        assert s["gpu_stalls_s"] >= 0 and s["gather_stalls_s"] >= 0 and s["gpu_stalls_s"] + s["gather_stalls_s"] > 0
        assert s["gpu_forward_s"] is None and s["waits"] == []  # CUDA events: none on the CPU
        assert sorted(c for c, _, _ in s["slices"]) == sorted(rec["plan"]["offload"])  # each updated once
    assert rec["cpu_Gps_alone"] > 0 and rec["median_step_s"] > 0 and rec["card"] == "cpu"


def test_the_trainers_loop_is_stamped_by_its_callbacks(tmp_path, capsys):
    """``--system elixir_trainer``: the same phases from ``ElixirTrainer.train()``, the updates
    from the engine's trace, and the loop between steps (the Trainer's logging, its next batch)."""
    out = tmp_path / "anatomy.json"
    step_anatomy.main(
        ["--model", "tiny", "--system", "elixir_trainer", "--batch-size", "2", "--seq", "64", "--steps", "2",
         "--offload", "0.5", "--threads", "2", "--device", "cpu", "--json", str(out)]
    )  # fmt: skip
    rec = json.loads(out.read_text())
    assert rec["system"] == "elixir_trainer" and len(rec["plan"]["offload"]) > 0 and len(rec["steps"]) == 2
    offloaded = rec["steps"][0]["cpu_elements"]
    for s in rec["steps"]:
        assert s["cpu_elements"] == offloaded > 0 and s["cpu_Gps"] > 0
        assert 0 <= s["waits_s"] <= s["forward_s"] and s["forward_s"] + s["backward_s"] <= s["step_s"]
        assert s["loop_s"] >= 0 and s["optimizer_s"] >= 0
    assert rec["cpu_Gps_alone"] is None and "elixir_trainer: tiny" in capsys.readouterr().out


def test_the_trainers_run_takes_the_device_lane(tmp_path):
    """``--device-lane on`` reaches ``ElixirTrainer``'s spec: slices of the offloaded chunks are
    updated by the device lane (on the CPU here, its torch kernel), the rest by the CPU lane."""
    out = tmp_path / "anatomy.json"
    step_anatomy.main(
        ["--model", "tiny", "--system", "elixir_trainer", "--batch-size", "2", "--seq", "64", "--steps", "2",
         "--offload", "0.5", "--device-lane", "on", "--threads", "2", "--device", "cpu", "--json", str(out)]
    )  # fmt: skip
    rec = json.loads(out.read_text())
    assert rec["plan"]["device_lane"] > 0
    assert sum(s["device_lane_elements"] for s in rec["steps"]) > 0


def test_a_fused_head_chunk_is_updated_first_unless_told_chunk_order(tmp_path, capsys):
    """``--fused-head``: the head's weight is read outside its module, so its chunk is the root's;
    offloaded, the engine's CPU lane starts each step's update with it, ``--update-order chunk``
    with chunk 0 (the A/B), and the losses are the same either way. A Llama: its head is not tied
    to the embedding (GPT-2's is, whose chunk is the first anyway)."""
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    recs = {}
    for order in ("root_first", "chunk"):
        out = tmp_path / f"{order}.json"
        step_anatomy.main(
            ["--model", str(tmp_path), "--batch-size", "2", "--seq", "64", "--steps", "2", "--offload", "1.0",
             "--threads", "2", "--fused-head", "--update-order", order, "--device", "cpu", "--json", str(out)]
        )  # fmt: skip
        recs[order] = json.loads(out.read_text())
    capsys.readouterr()
    [root] = recs["root_first"]["root_chunks"]
    assert root != 0 and root in recs["root_first"]["plan"]["offload"]
    assert [s["first_updated"] for s in recs["root_first"]["steps"]] == [root, root]
    assert [s["first_updated"] for s in recs["chunk"]["steps"]] == [0, 0]
    losses = {order: [s["loss"] for s in rec["steps"]] for order, rec in recs.items()}
    assert losses["root_first"] == losses["chunk"] and len(set(losses["chunk"])) == 2  # trained, and alike
