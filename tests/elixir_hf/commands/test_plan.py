"""``elixir-plan``: presets, config files, JSON and PNG output, failures, and its speed on OPT-175B."""

from __future__ import annotations

import json
import re

import pytest
import torch

from elixir_hf.commands.plan import main, parse_size
from elixir_hf.plugin import ElixirSpecError
from elixir_runtime.config import ElixirConfig
from elixir_runtime.hardware import HardwareProfile, LinkRates
from elixir_runtime.hardware.profile import CpuAdamRate
from elixir_runtime.profiler import profile_model
from helpers.spec_keys import documented_keys, documented_value


@pytest.fixture
def hardware(tmp_path) -> str:
    """A made-up two-GPU host (test data; the CLI measures or loads real ones)."""
    hw = HardwareProfile(
        device="test GPU",
        gpus=2,
        gpu_memory=80 * 2**30,
        host_memory=256 * 2**30,
        cpu_cores=16,
        matmul={"1024": 300e12, "4096": 600e12},
        attention={"2048": 300e12},
        memory_bandwidth=3e12,
        op_overhead=1e-5,
        gpu_adam=80e9,
        cpu_adam={1: CpuAdamRate(1, 15, 5e9)},
        links={n: LinkRates(n, 50e9 * n, 50e9 * n, 35e9 * n) for n in (1, 2)},
        source="test data",
    )
    path = tmp_path / "hw.json"
    hw.save(path)
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_parse_size() -> None:
    assert parse_size("80GiB") == 80 * 2**30 == parse_size("80G") == parse_size("80")
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5TiB") == int(1.5 * 2**40)
    assert parse_size("512mib") == 512 * 2**20
    with pytest.raises(Exception, match="not a memory size"):
        parse_size("80 bananas")


def test_preset_plan_as_json(capsys, hardware) -> None:
    code, out, _ = _run(
        capsys,
        "--model",
        "gpt2",
        "--batch-size",
        "4",
        "--seq-len",
        "256",
        "--gpu-mem",
        "3GiB",
        "--host-mem",
        "64GiB",
        "--hardware",
        hardware,
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    plan = doc["plan"]
    assert plan["n_chunks"] > 0 and plan["predicted"]["total"] > 0
    assert (
        plan["memory"]["rcache"] + plan["memory"]["private"] + plan["memory"]["device_shards"]
        <= plan["budget"]["allowed"]
    )
    assert [a["name"] for a in plan["alternatives"]] == [
        "zero2-offload-all",
        "zero3-offload-all",
        "rcache-max",
        "rcache-min",
    ]
    assert doc["profile"]["ac_regions"] == 12 and doc["profile"]["tied"] == ["transformer.wte.weight"]
    assert set(doc["timings"]) == {"build_s", "profile_s", "search_s"}


def test_plans_for_the_lean_loss_unless_told_otherwise(capsys, hardware) -> None:
    """As an Elixir run installs it (``elixir_hf/loss.py``): GPT-2 at 4 x 256 tokens (vocab 50257, one
    fp32 copy of the logits 206 MB) profiles a peak lower by more than 1.25 such copies than with
    ``--stock-loss`` (the stock loss holds 3 in backward, the lean one the bf16 logits, their gradient
    and 3/8 of a copy; 641 -> 333 MB observed)."""
    peaks = []
    for extra in ((), ("--stock-loss",)):
        code, out, _ = _run(
            capsys, "--model", "gpt2", "--batch-size", "4", "--seq-len", "256", "--hardware", hardware, "--json", *extra
        )
        assert code == 0
        peaks.append(json.loads(out)["profile"]["activation_peak"])
    assert peaks[1] - peaks[0] > 1.25 * 4 * 256 * 50257 * 4, peaks


def test_the_issue_example_in_plain_words_and_a_png(capsys, hardware, tmp_path) -> None:
    """The default text says what a user decides on, in their words: memory per GPU by part, host
    memory, what is offloaded (which layers) and why, the predicted step and TFLOPS; the planner's
    terms wait for --verbose. The plot's file is named."""
    png = tmp_path / "plan.png"
    code, out, _ = _run(
        capsys,
        "--model",
        "gpt2-10b",
        "--seq-len",
        "1024",
        "--batch-size",
        "8",
        "--gpus",
        "2",
        "--gpu-mem",
        "80GiB",
        "--host-mem",
        "256GiB",
        "--hardware",
        hardware,
        "--plot",
        str(png),
    )
    assert code == 0
    for words in (
        "GPU memory per GPU",
        "model states on the GPU",
        "gathered-parameter cache",
        "activations (peak)",
        "host memory: nothing pinned",
        "offloaded: nothing",
        "predicted step",
        "TFLOPS per GPU",
        "ZeRO-3-like offload-all",
        "host: 256.00 GiB RAM, as given (--host-mem)",
        f"plot written to {png}",
    ):
        assert words in out, words
    assert out.count("8 x 1024") == 1, out  # the batch, once
    for jargon in ("U_allowed", "I(n)", "private ones", "== profile ==", "zero3-offload-all", "``"):
        assert jargon not in out, jargon
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verbose_adds_the_planners_workings(capsys, tmp_path) -> None:
    base = [
        "--model",
        _tiny_config(tmp_path),
        "--seq-len",
        "128",
        "--batch-size",
        "2",
        "--gpu-mem",
        "6MiB",
        "--host-mem",
        "64GiB",
        "--hardware",
        "h100",
    ]
    code, plain, _ = _run(capsys, *base)
    assert code == 0 and "--verbose" in plain  # said where the rest is
    code, out, _ = _run(capsys, *base, "--verbose")
    assert code == 0 and out.startswith(plain.split("\n\nmore:")[0])
    for words in (
        "== profile ==",
        "== plan ==",
        "I(n) / J(n)",
        "U_allowed = F_alloc x (capacity",
        "== alternatives",
        "zero3-offload-all",
        "== chunk sizes tried ==",
        "<- chosen",
        "profiled in",
    ):
        assert words in out, words
    assert out.count("2x128") == 1, out  # the profile's batch: input ids and labels, said once
    # 6 MiB: every chunk offloaded (how many: the chunk size the search picks), the layers named, and why
    assert re.search(r"offloaded: (\d+) of \1 chunks \(wte, wpe, h\.0-3, ln_f\)", plain), plain
    assert "why: keeping every chunk on the GPU" in plain


def test_no_third_party_warnings(capsys, tmp_path) -> None:
    """transformers' use_cache and token-id warnings (a checkpointed tiny GPT-2 with a small vocab
    raises both) and Python warnings stay out of the output; the plot's file is named on stdout."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    logging.Logger.warning_once.cache_clear()  # transformers' say-once warnings, said by earlier tests
    records: list[logging.LogRecord] = []
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = records.append
    library = hf_logging.get_logger()
    library.addHandler(catcher)
    png = tmp_path / "plan.png"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code, out, err = _run(
                capsys,
                "--model",
                _tiny_config(tmp_path),
                "--seq-len",
                "128",
                "--batch-size",
                "2",
                "--hardware",
                "h100",
                "--plot",
                str(png),
            )
    finally:
        library.removeHandler(catcher)
    assert code == 0 and err == "", err
    assert not records, [r.getMessage() for r in records]
    assert not [w for w in caught if not issubclass(w.category, DeprecationWarning)], [str(w.message) for w in caught]
    assert f"plot written to {png}" in out and png.is_file()


def test_help_is_plain_text(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "``" not in out and "--verbose" in out and "gathered-parameter cache" in out


def test_chunks_are_named_by_the_layers_they_hold() -> None:
    from elixir_runtime.plan_view import describe_layers

    names = [
        "transformer.wte.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.mlp.c_fc.bias",
        "transformer.h.3.ln_1.weight",
        "transformer.ln_f.weight",
        "lm_head.weight",
    ]
    assert describe_layers(names) == "wte, h.0-1,3, ln_f, lm_head"
    assert (
        describe_layers(["model.layers.12.self_attn.q_proj.weight", "model.layers.13.mlp.up_proj.weight"])
        == "layers.12-13"
    )


def test_the_plot_bar_holds_everything_the_plan_puts_on_the_gpu(hardware) -> None:
    """The model states in the picture end where the plan's device memory does (gradient shards
    included: GPT2-10b at batch 8 keeps some beyond the activations' slack), inside U_allowed; the
    host bar holds the pinned shards of both GPUs."""
    from elixir_hf.commands.plan import _elixir_config, _parser
    from elixir_hf.commands.plan.hardware import plan_hardware
    from elixir_hf.commands.plan.plot import host_bars, memory_bars
    from elixir_hf.commands.plan.report import plan_report

    args = _parser().parse_args(
        [
            "--model",
            "gpt2-10b",
            "--seq-len",
            "1024",
            "--batch-size",
            "8",
            "--gpus",
            "2",
            "--gpu-mem",
            "80GiB",
            "--host-mem",
            "256GiB",
            "--hardware",
            hardware,
        ]
    )
    plan = plan_report(args, _elixir_config(args), *plan_hardware(args)).plan
    budget = plan.budget
    bars = dict((label, size) for label, size, _ in memory_bars(plan))
    assert (
        plan.memory.device_grads > 0
        and bars["their gradients, beyond what the activations free"] == plan.memory.device_grads
    )
    states = sum(size for label, size in bars.items() if not label.startswith(("activations", "buffers")))
    assert states == plan.device_bytes <= budget.allowed
    assert sum(size for _, size, _ in host_bars(plan)) == 2 * plan.host_bytes


def test_config_file_and_underscore_flags(capsys, hardware, tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "vocab_size": 1000,
            }
        )
    )
    code, out, _ = _run(
        capsys,
        "--model_config",
        str(config),
        "--gpu_mem",
        "1GiB",
        "--host_mem",
        "8GiB",
        "--seq_len",
        "128",
        "--batch_size",
        "2",
        "--hardware",
        hardware,
        "--no-ac",
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["profile"]["ac_regions"] == 0 and doc["plan"]["n_chunks"] > 0


def test_nothing_fits_exits_2_with_the_numbers(capsys, hardware) -> None:
    code, _, err = _run(capsys, "--model", "gpt2-xl", "--gpu-mem", "8GiB", "--host-mem", "4GiB", "--hardware", hardware)
    assert code == 2
    assert "no plan fits" in err and "per GPU is left for them" in err and "To make it fit" in err
    assert "U_allowed" not in err  # the budget's symbol: --verbose only
    code, _, err = _run(
        capsys, "--model", "gpt2-xl", "--gpu-mem", "8GiB", "--host-mem", "4GiB", "--hardware", hardware, "-v"
    )
    assert code == 2 and "U_allowed = " in err


@pytest.mark.perf
def test_opt_175b_profile_and_search_times(capsys, hardware) -> None:
    code, out, _ = _run(
        capsys,
        "--model",
        "opt-175b",
        "--seq-len",
        "2048",
        "--batch-size",
        "1",
        "--gpus",
        "2",
        "--gpu-mem",
        "80GiB",
        "--host-mem",
        "4TiB",
        "--hardware",
        hardware,
        "--json",
    )
    assert code == 0
    timings = json.loads(out)["timings"]
    assert timings["profile_s"] < 5 and timings["search_s"] < 10, timings


# --------------------------------------------------------------------------- without a GPU (issue 11 item 6)

TINY_GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_layer": 4, "n_head": 4, "vocab_size": 1000, "n_positions": 256}


def _tiny_config(tmp_path, data: dict = TINY_GPT2) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [  # before: a bare JSONDecodeError naming no file, a KeyError, TypeError or RuntimeError traceback
        ("", "not a model's config.json (JSONDecodeError: Expecting value"),
        ("{}", "not a model's config.json (KeyError: 'model_type')"),
        ("[1]", "not a model's config.json (TypeError: "),
        (json.dumps({**TINY_GPT2, "n_embd": -5}), "its config builds no model: Trying to create tensor with negative"),
        (json.dumps({**TINY_GPT2, "n_embd": 130}), "its config builds no model: `embed_dim` must be divisible by"),
    ],
)
def test_a_config_file_that_builds_no_model_is_named(capsys, tmp_path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    assert main(["--model", str(path), "--gpu", "h100"]) == 1
    assert capsys.readouterr().err.startswith(f"elixir-plan: --model {path}: {message}")


@pytest.mark.parametrize(
    ("text", "message"),
    [("{}", "is not one (HardwareProfile.__init__() missing 10 required"), ("[1]", "is not a JSON object: list")],
)
def test_a_hardware_file_that_is_no_profile_is_named(capsys, tmp_path, text: str, message: str) -> None:
    """Before: a ``TypeError`` traceback."""
    path = tmp_path / "hw.json"
    path.write_text(text)
    assert main(["--model", _tiny_config(tmp_path), "--hardware", str(path)]) == 1
    assert capsys.readouterr().err.startswith(f"elixir-plan: --hardware {path}: hardware profile {path} {message}")


def test_without_a_gpu_the_shipped_h100_is_planned_for_and_named(capsys, tmp_path, monkeypatch) -> None:
    """Never this machine's CPU timings for a GPU plan: the shipped H100 profile, said so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ELIXIR_HARDWARE", raising=False)
    code, out, _ = _run(capsys, "--model", _tiny_config(tmp_path), "--seq-len", "128", "--batch-size", "2")
    assert code == 0 and out.endswith("\n")
    assert (
        "GPU:  NVIDIA H100 80GB HBM3, 79.18 GiB; no GPU here and no --gpu or --hardware: planned for the shipped h100 "
        "profile (its card and host)" in out
    )
    code, out, _ = _run(capsys, "--model", _tiny_config(tmp_path), "--seq-len", "128", "--batch-size", "2", "--json")
    doc = json.loads(out)
    assert doc["hardware"]["device"] == "NVIDIA H100 80GB HBM3" and "shipped" in doc["hardware"]["note"]
    assert doc["plan"]["search"]["hardware"]["device"] == "NVIDIA H100 80GB HBM3"


def test_a_cpu_profile_is_refused_for_a_gpu_plan(capsys, tmp_path) -> None:
    cpu = HardwareProfile(
        device="cpu",
        gpus=0,
        gpu_memory=64 * 2**30,
        host_memory=64 * 2**30,
        cpu_cores=2,
        matmul={"1024": 1e11},
        attention={"2048": 1e11},
        memory_bandwidth=1e10,
        op_overhead=1e-5,
        gpu_adam=1e9,
        cpu_adam={1: CpuAdamRate(1, 15, 1e9)},
        links={1: LinkRates(1, 1e10, 1e10)},
        source="a laptop",
    )
    cpu.save(tmp_path / "cpu.json")
    assert main(["--model", "gpt2", "--hardware", str(tmp_path / "cpu.json")]) == 1
    assert "measured on a CPU" in capsys.readouterr().err


def test_cli_and_auto_make_the_same_plan_from_the_same_profile(capsys, tmp_path, monkeypatch) -> None:
    """``elixir-plan --hardware h100`` and prepare's ``--elixir auto`` decision (``planner.search_job``)
    with the same profile and memory give the same plan."""
    import elixir_runtime.planner as planner
    from elixir_hf.commands.plan.report import build_meta_model, model_config
    from elixir_hf.loss import use_lean_loss
    from elixir_hf.patches import mask_decisions_of
    from elixir_runtime.config import ElixirConfig
    from elixir_runtime.distributed.collectives import Collectives
    from elixir_runtime.search import Budget
    from elixir_runtime.units import find_units

    gpu, host = 6 * 2**20, 64 * 2**30  # small enough that the choice is not "everything on the GPU"
    code, out, _ = _run(
        capsys,
        "--model",
        _tiny_config(tmp_path),
        "--seq-len",
        "128",
        "--batch-size",
        "2",
        "--gpu-mem",
        f"{gpu}B",
        "--host-mem",
        f"{host}B",
        "--hardware",
        "h100",
        "--device-lane",
        "auto",
        "--json",
    )
    assert code == 0, out
    cli_plan = json.loads(out)["plan"]

    monkeypatch.setenv("ELIXIR_HARDWARE", "h100")
    monkeypatch.setattr(
        planner, "device_budget", lambda device, act, buffers, on_host: Budget(gpu, act, buffers, host, on_host.ranks)
    )
    model = build_meta_model(model_config(_tiny_config(tmp_path), 128), torch.bfloat16, checkpointing=True)
    use_lean_loss(model)  # as build_engine does before prepare
    units = find_units(model, None)
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    config, cuda = ElixirConfig(dtype="bf16", device_assisted_update="auto"), torch.device("cuda")
    batch = {"input_ids": ids, "labels": ids}
    with mask_decisions_of(batch):  # as build_engine does around prepare
        plan = planner.search_job(
            planner.PlanJob(model, units, batch, config, cuda, torch.bfloat16, Collectives(None))
        ).plan
    assert cli_plan["offload"] or cli_plan["n_blocks"] < cli_plan["max_blocks"], "the case must make a choice"
    saved = plan.to_dict()
    for key in ("chunk_size", "n_chunks", "n_blocks", "offload", "device_lane", "memory", "predicted"):
        assert cli_plan[key] == saved[key], key
    # on 6 MiB the device lane's staging leaves no plan: "auto" falls back to the CPU alone, saying so
    assert plan.device_lane == 0 and any("device update lane off" in n for n in plan.search.notes)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--gpus", "0", "must be a positive integer"),
        ("--batch-size", "-1", "must be a positive integer"),
        ("--dtype", "int8", "unknown dtype 'int8'"),
        ("--gpu-memory", "0GiB", "ElixirConfig.gpu_memory must be at least 1 MiB, got 0 bytes"),
        ("--gpu-memory", "lots", "ElixirConfig.gpu_memory: not a memory size: 'lots'"),
        # before: planned as the card's own size (0 is falsy), a host of 0 bytes as no limit, a full fine-tune
        ("--gpu-mem", "0", "must be at least 1 MiB, got '0' (0 bytes)"),
        ("--host-mem", "0.5MiB", "must be at least 1 MiB, got '0.5MiB' (524288 bytes), or 'here'"),
        ("--lora-targets", " , ", "names no module: ' , '; give some, e.g. q_proj,v_proj, or leave it out"),
    ],
)
def test_bad_arguments_are_argparse_errors(capsys, flag, value, message) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--model", "gpt2", flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and f"argument {flag}" in err and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [  # before: a traceback after the plan or the minutes of measuring, flags ignored, --no-ac's clash after its profile
        (["--model", "gpt2", "--plot", "{tmp}/no/plan.png"], "--plot {tmp}/no/plan.png: the folder {tmp}/no does not"),
        (["--measure-hardware", "{tmp}/no/hw.json"], "--measure-hardware {tmp}/no/hw.json: the folder {tmp}/no does"),
        (
            ["--measure-hardware", "{tmp}/hw.json", "--model", "gpt2", "--gpus", "2"],
            "--measure-hardware measures this machine and takes no other flag, not --model, --gpus",
        ),
        (["--run", "{tmp}", "--gpus", "2"], "--run reads a run's records and takes --plot and --json only, not --gpus"),
        (["--model", "gpt2", "--plot", "{tmp}"], "--plot {tmp} is a folder: name a file, e.g. {tmp}/plan.png"),
        (["--model", "gpt2", "--plot", "{tmp}/plan.txt"], "--plot {tmp}/plan.txt: the plot is a PNG: name a .png file"),
        (["--measure-hardware", "{tmp}"], "--measure-hardware {tmp} is a folder: name a file, e.g. {tmp}/hw.json"),
        (
            ["--model", "gpt2", "--no-ac", "--elixir", '{{"activations": "host"}}'],
            "--no-ac with activations 'host': the host holds block inputs only for a recompute",
        ),
    ],
)
def test_what_a_flag_cannot_do_is_refused_before_any_work(capsys, tmp_path, argv, message) -> None:
    with pytest.raises(SystemExit) as exc:
        main([a.format(tmp=tmp_path) for a in argv])
    assert exc.value.code == 1 and f"elixir-plan: error: {message.format(tmp=tmp_path)}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing measured or written"


def test_gpu_memory_caps_the_card(capsys, tmp_path) -> None:
    """``--gpu-memory`` (``ElixirConfig.gpu_memory``) shrinks the shipped H100's budget, and a card
    capped at X plans as a card of X with the same rates (the 80 GB regime on a 141 GB card)."""
    cap = 6 * 2**20  # small enough that the choice is not "everything on the GPU"
    base = [
        "--model",
        _tiny_config(tmp_path),
        "--seq-len",
        "128",
        "--batch-size",
        "2",
        "--host-mem",
        "64GiB",
        "--hardware",
        "h100",
        "--json",
    ]

    def plan(*flags: str) -> dict:
        code, out, err = _run(capsys, *base, *flags)
        assert code == 0, err
        return json.loads(out)["plan"]

    whole, capped = plan(), plan("--gpu-memory", f"{cap}B")
    assert (capped["gpu_memory"], capped["budget"]["capacity"], capped["budget"]["limit"]) == (cap, cap, cap)
    assert whole["gpu_memory"] is None and whole["budget"]["capacity"] == 85017493504  # the H100's
    assert len(capped["offload"]) > len(whole["offload"]) or capped["n_blocks"] < whole["n_blocks"]
    smaller_card = plan("--gpu-mem", f"{cap}B")  # the H100 capped at X plans as a card of X, same rates
    for key in ("chunk_size", "n_chunks", "n_blocks", "offload", "memory", "predicted"):
        assert smaller_card[key] == capped[key], key

    code, out, _ = _run(capsys, *base, "--gpu-memory", "90GiB")
    assert code == 1 and "--gpu-memory 90.00 GiB is more than the 79.18 GiB of the GPU planned for (NVIDIA H100" in out


def test_a_model_without_sdpa_is_built_with_its_own_attention(capsys, tmp_path) -> None:
    """Gemma-2 has no sdpa path in transformers: the CLI plans it with its own (eager) attention."""
    gemma2 = {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 256,
    }
    code, out, err = _run(
        capsys,
        "--model",
        _tiny_config(tmp_path, gemma2),
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--hardware",
        "h100",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["plan"]["n_chunks"] > 0


def test_a_rate_a_job_recorded_here_is_planned_with_and_shown(capsys, tmp_path) -> None:
    """``cpu_adam[1].observed`` (a job's own CPU update rate, docs/planning.md "The run's own rate"):
    the plan prices the offloaded updates at it and its rates line says so."""
    from elixir_runtime.hardware.load import shipped_hardware

    def plan(observed: float | None) -> str:
        hw = shipped_hardware("h100")
        hw.cpu_adam[1].observed = observed
        path = tmp_path / f"hw-{observed}.json"
        hw.save(path)
        base = ["--model", _tiny_config(tmp_path), "--seq-len", "128", "--batch-size", "2", "--gpu-mem", "6MiB"]
        code, out, _ = _run(capsys, *base, "--host-mem", "64GiB", "--hardware", str(path), "--verbose")
        assert code == 0
        return out

    measured, slow = plan(None), plan(1e6)
    assert "in a run here" in slow and "in a run here" not in measured
    step = [float(o.split("predicted step: ")[1].split(" s")[0]) for o in (measured, slow)]
    assert step[1] > 2 * step[0]  # every chunk offloaded, updated at 1 M elements/s


def test_a_host_bound_step_is_priced_with_two_micro_batches(capsys, tmp_path, monkeypatch) -> None:
    """Where CPU updates not hidden are a quarter of the step or more, ``elixir-plan`` plans two
    micro-batches per step too (the update is once per optimizer step): text and JSON. The step is
    profiled once for both plans."""
    from elixir_runtime import planner
    from elixir_runtime.hardware.load import shipped_hardware

    profiled = []
    monkeypatch.setattr(planner, "profile_model", lambda *a, **k: profiled.append(1) or profile_model(*a, **k))

    def run(cpu_rate: float, *extra: str) -> tuple[str, dict]:
        hw = shipped_hardware("h100")
        hw.cpu_adam[1] = CpuAdamRate(1, 15, cpu_rate, cpu_rate)
        path = tmp_path / f"hw-{cpu_rate}.json"
        hw.save(path)
        base = ["--model", _tiny_config(tmp_path), "--seq-len", "128", "--batch-size", "2", "--gpu-mem", "6MiB"]
        base += ["--host-mem", "64GiB", "--hardware", str(path), *extra]
        code, out, _ = _run(capsys, *base)
        code_json, doc, _ = _run(capsys, *base, "--json")
        assert code == code_json == 0
        return out, json.loads(doc)

    out, doc = run(1e6)  # every chunk offloaded, updated at 1 M elements/s: host-bound
    assert "host-bound:" in out and "with 2 micro-batches per step (--grad-accum 2" in out
    assert len(profiled) == 2  # the text's run and the JSON's, each planning twice
    one, two = doc["plan"]["predicted"]["total"], doc["accumulated"]["predicted_step_s"]
    assert doc["accumulated"]["grad_accum"] == 2 and one < two < 2 * one  # twice the tokens in less than twice the time
    out, doc = run(1e12)  # the update hides under the step
    assert "host-bound" not in out and "accumulated" not in doc
    out, doc = run(1e6, "--grad-accum", "2")  # already accumulating: nothing to suggest
    assert "host-bound" not in out and "accumulated" not in doc


def test_plans_for_other_boxes_reuse_the_profiled_step(tmp_path, monkeypatch, capsys) -> None:
    """``main(argv, profiles=)``: a step profiled by an earlier call in the process (another card, host or GPU
    count) is not profiled again, and its plan is the one a fresh profile gives; another batch is profiled."""
    from elixir_runtime import planner

    profiled = []
    monkeypatch.setattr(planner, "profile_model", lambda *a, **k: profiled.append(1) or profile_model(*a, **k))
    base = ["--model", _tiny_config(tmp_path), "--seq-len", "128", "--gpu-mem", "6MiB", "--json"]
    boxes = (["--gpu", "h100", "--host-mem", "64GiB"], ["--gpu", "h200", "--host-mem", "8GiB", "--gpus", "2"])
    profiles: dict = {}
    shared = [main([*base, "--batch-size", "2", *box], profiles=profiles) or capsys.readouterr().out for box in boxes]
    assert len(profiled) == 1 and len(profiles) == 1
    fresh = [_run(capsys, *base, "--batch-size", "2", *box)[1] for box in boxes]
    decided = ("chunk_size", "n_blocks", "offload", "memory", "predicted")  # not the seconds each part took
    assert [{k: json.loads(d)["plan"][k] for k in decided} for d in shared] == [
        {k: json.loads(d)["plan"][k] for k in decided} for d in fresh
    ]
    main([*base, "--batch-size", "4", *boxes[0]], profiles=profiles)  # fits or not: its step is profiled first
    assert len(profiled) == 1 + len(fresh) + 1 and len(profiles) == 2


# --------------------------------------------------------------------------- --elixir: the run's keys


def _config(*argv: str):
    from elixir_hf.commands.plan import _elixir_config, _parser

    args = _parser().parse_args(["--model", "gpt2", *argv])
    return _elixir_config(args), args


@pytest.mark.parametrize("key", documented_keys())
def test_every_key_the_docs_name_is_an_elixir_plan_key(key: str) -> None:
    """``elixir-plan --elixir`` parses as the run's ``--elixir`` (``ElixirPlugin``): each key of
    docs/hf.md's table, at its documented default, is accepted."""
    config, _ = _config("--elixir", json.dumps({key: documented_value(key)}, default=str))
    assert isinstance(config, ElixirConfig), key


def test_the_flags_are_shorthands_for_elixir_keys() -> None:
    config, args = _config("--elixir", '{"offload": 0.5, "n_blocks": "min", "lean_loss": false}', "--grad-accum", "2")
    assert (config.offload, config.n_blocks, config.grad_accum_steps, config.dtype) == (0.5, "min", 2, torch.bfloat16)
    assert args.lean_loss is False and args.dtype == torch.bfloat16  # what the report reads
    config, args = _config("--dtype", "fp16", "--gpu-memory", "40GiB", "--device-lane", "auto", "--stock-loss")
    assert (config.dtype, config.gpu_memory, config.device_assisted_update) == (torch.float16, 40 * 2**30, "auto")
    assert args.gpu_memory == 40 * 2**30 and args.lean_loss is False
    assert (
        _config("--dtype", "fp32", "--elixir", '{"dtype": "fp32"}')[0].dtype == torch.float32
    )  # said twice, once meant
    with pytest.raises(ElixirSpecError, match="--dtype says dtype 'fp16', --elixir says 'bf16': give it once"):
        _config("--dtype", "fp16", "--elixir", '{"dtype": "bf16"}')
    with pytest.raises(ElixirSpecError, match="unknown elixir-plan --elixir key 'ofload' \\(did you mean 'offload'"):
        _config("--elixir", '{"ofload": 0.5}')
    with pytest.raises(ElixirSpecError, match="not a plan or mode 'static'"):
        _config("--elixir", '{"mode": "static"}')


def test_an_elixir_key_reaches_the_plan(capsys, tmp_path) -> None:
    """``{"offload": 1.0}``: every chunk offloaded, as the run with that ``--elixir`` would plan."""
    argv = ["--model", _tiny_config(tmp_path), "--seq-len", "128", "--batch-size", "2", "--hardware", "h100"]
    code, out, _ = _run(capsys, *argv, "--elixir", '{"offload": 1.0}', "--json")
    assert code == 0, out
    plan = json.loads(out)["plan"]
    assert plan["offload"] == list(range(plan["n_chunks"])) and json.loads(out)["settings"]["elixir"] == {
        "offload": 1.0
    }


def test_an_exact_plan_that_offloads_shows_what_8bit_moments_would_buy(capsys, tmp_path) -> None:
    """Never switched to: the plan stays exact and a line prices 8-bit moments; where exact does not fit
    at all, the error says the 8-bit plan that would."""
    base = ["--model", _tiny_config(tmp_path), "--seq-len", "128", "--batch-size", "2", "--hardware", "h100"]
    code, out, _ = _run(capsys, *base, "--gpu-mem", "9MiB", "--host-mem", "64GiB", "--json")
    plan = json.loads(out)["plan"]
    assert code == 0 and plan["moments"] == "fp32" and plan["offload"]
    (option,) = plan["search"]["moments"]
    assert (
        option["moments"] == "8bit"
        and option["offloaded"] / option["n_chunks"] < len(plan["offload"]) / plan["n_chunks"]
    )
    code, text, _ = _run(capsys, *base, "--gpu-mem", "9MiB", "--host-mem", "64GiB")
    assert re.search(
        r"moments 8bit: \d+ of \d+ chunks offloaded, .* not exact AdamW \(--elixir '\{\"moments\": \"8bit\"\}'", text
    )
    code, _, err = _run(capsys, *base, "--gpu-mem", "6MiB", "--host-mem", "10MiB")
    assert code == 2 and "no plan fits" in err and "8-bit Adam moments" in err
    code, out, _ = _run(capsys, *base, "--gpu-mem", "6MiB", "--host-mem", "10MiB", "--moments", "8bit", "--json")
    assert (
        code == 0
        and json.loads(out)["plan"]["moments"] == "8bit"
        and "moments" not in json.loads(out)["plan"]["search"]
    )
