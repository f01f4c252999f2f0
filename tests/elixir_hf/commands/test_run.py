"""``elixir-run``: unmodified scripts (``scripts/``: an HF Trainer script, an Accelerate loop, a
TRL SFT script with an optional PEFT LoRA adapter) train with the Elixir engine and log the stock
runs' losses (fp32 on CPU, relative 1e-5), at 1 rank and at 2 gloo ranks, under each launcher users
type: ``python -m elixir_hf.commands.run``, ``torchrun -m elixir_hf.commands.run`` (the stock 2-rank runs) and
``accelerate launch --config_file recipes/elixir.yaml -m elixir_hf.commands.run`` (the Elixir 2-rank run).

The stock 1-rank runs execute the script in this process (no Elixir class is touched there);
everything through ``elixir-run`` and every 2-rank run is a subprocess. Through ``elixir-run`` the
scripts' ``from_pretrained`` streams the weights into the chunks (a LoRA adapter: read on rank 0).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_cases import OFFLOAD_PLAN, save_tiny_lm
from safetensors.torch import load_file

from elixir_hf.checkpoint.optimizer_files import optim_file_name
from elixir_hf.commands.run import main, split_elixir
from helpers.hub import cache_snapshot

SCRIPTS = Path(__file__).with_name("scripts")
ROOT = Path(__file__).parents[3]
SRC = ROOT / "src"
RTOL = 1e-5
PLAN_LINE = "Elixir plan for"
TRAINER_ARGS = [  # clipping active (max_grad_norm 0.5 < the typical norm), an evaluation half-way
    *("--max_steps", "6", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"),
    *("--learning_rate", "1e-2", "--adam_epsilon", "1e-6", "--weight_decay", "0.1", "--max_grad_norm", "0.5"),
    *("--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "3", "--save_strategy", "no"),
    *("--report_to", "none", "--use_cpu", "--seed", "0", "--disable_tqdm", "true"),
]


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))


def _launch(cmd: list[str], env: dict[str, str] | None = None) -> str:
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    proc = subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    out = proc.stdout  # one stream: the log lines stay between sequence.py's "== SCRIPT" lines
    assert proc.returncode == 0, out[-6000:]
    return out


def _elixir_run(ranks: int, *args: str, env: dict[str, str] | None = None) -> str:
    """1 rank: ``python -m elixir_hf.commands.run``. 2 ranks: the recipe's own ``accelerate launch`` line
    (recipes/elixir.yaml: 2 processes, bf16), with mixed precision off for the fp32 comparison and a
    free port; the scripts' ``--use_cpu``/``--cpu`` make the Trainer and Accelerator count both ranks."""
    launcher = (
        [sys.executable]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "recipes" / "elixir.yaml"),
            "--num_processes",
            str(ranks),
            "--mixed_precision",
            "no",
            "--main_process_port",
            "0",
        ]
    )
    # the plan is an INFO log line: shown at TRANSFORMERS_VERBOSITY=info, on rank 0 only
    return _launch(
        [*launcher, "-m", "elixir_hf.commands.run", *args], {"TRANSFORMERS_VERBOSITY": "info", **(env or {})}
    )


def _stock(ranks: int, script: Path, *args: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if ranks > 1:
        _launch(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(ranks),
                str(script),
                *args,
            ]
        )
        return
    with monkeypatch.context() as m:
        m.setattr(sys, "argv", [str(script), *args])
        if script.name == "sequence.py":  # its runs, without the os._exit that ends a launch
            sequence = runpy.run_path(str(script))
            sequence["run_all"](sequence["split"](list(args)))
        else:
            runpy.run_path(str(script), run_name="__main__")


def _history(output_dir: Path, key: str) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [h[key] for h in state["log_history"] if key in h]


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) > 0, (what, got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=RTOL), f"{what}[{i}]: elixir-run {g} vs stock {w}"


# --------------------------------------------------------------------------- the launcher's own grammar


def test_elixir_is_taken_out_of_the_scripts_arguments() -> None:
    assert split_elixir(["t.py", "--lr", "1", "--elixir", "off"]) == ("off", ["t.py", "--lr", "1"])
    assert split_elixir(["--elixir", "t.py", "--x"]) == ("auto", ["t.py", "--x"])  # bare flag: auto
    assert split_elixir(["t.py", "--elixir", "--x", "1"]) == ("auto", ["t.py", "--x", "1"])
    assert split_elixir(["t.py", '--elixir={"offload": 0.5}']) == ('{"offload": 0.5}', ["t.py"])
    assert split_elixir(["t.py", "--elixir", "plan.json", "y"]) == ("plan.json", ["t.py", "y"])
    assert split_elixir(["t.py", "--elixirx"]) == (None, ["t.py", "--elixirx"])
    for off in ("Off", "false", "NO", "none", "0"):  # every spelling of off is the flag's value
        assert split_elixir(["t.py", "--elixir", off, "--x"]) == (off, ["t.py", "--x"])
    assert split_elixir(["--elixir", "Auto", "t.py"]) == ("Auto", ["t.py"])


def test_a_word_after_a_bare_flag_is_refused_naming_it(tmp_path) -> None:
    """``--elixir yes`` is a mistyped value, not the script: refused before anything runs; a script
    (a path) or a flag after a bare ``--elixir`` still is what it was."""
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    for word in ("yes", "enabled", "of", "off.", "0.0", "no-"):  # before: off. and 0.0 ran the script with Elixir on
        with pytest.raises(SystemExit, match=f"elixir-run: --elixir '{word}' is not understood: use 'auto', 'off'"):
            main([str(script), "--elixir", word])
    assert not (tmp_path / "ran").exists()


def test_bad_launch_fails_before_the_script_runs(tmp_path) -> None:
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(SystemExit, match="elixir-run: unknown --elixir key 'ofload'"):
        main([str(script), "--elixir", '{"ofload": 0.5}'])
    with pytest.raises(SystemExit, match="name the script to run"):
        main(["--elixir", "auto"])
    assert not (tmp_path / "ran").exists()


# --------------------------------------------------------------------------- unmodified scripts, 1 and 2 ranks


# 2 ranks run the 1-rank case's transformers code again: on the newest transformers only (``once``)
@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
@pytest.mark.parametrize("ranks", [1, 2])
def test_trainer_script_and_accelerate_loop(model_dir, tmp_path, monkeypatch, ranks: int) -> None:
    """One launch trains both scripts (``scripts/sequence.py``), once stock and once through
    elixir-run (at 2 ranks under ``accelerate launch``, which starts torchrun's launcher with
    ``-m elixir_hf.commands.run``). ``--elixir`` comes last, after the Accelerate script's own arguments:
    neither script's parser sees it; at 1 rank the settings come from ``ELIXIR_CONFIG`` instead.
    Each script's engine prints its plan exactly once (rank 0)."""
    trainer_args = ["--model_name_or_path", str(model_dir), *TRAINER_ARGS]
    trainer_args += ["--ddp_backend", "gloo"] if ranks > 1 else []
    loop_args = ["--model_name_or_path", str(model_dir), "--cpu"]

    def scripts(run: str) -> list[str]:
        return [
            str(SCRIPTS / "hf_trainer.py"),
            *trainer_args,
            "--output_dir",
            str(tmp_path / run / "trainer"),
            "--",
            str(SCRIPTS / "accelerate_loop.py"),
            *loop_args,
            "--output_dir",
            str(tmp_path / run / "loop"),
        ]

    _stock(ranks, SCRIPTS / "sequence.py", *scripts("stock"), monkeypatch=monkeypatch)
    if ranks == 1:
        out = _elixir_run(ranks, str(SCRIPTS / "sequence.py"), *scripts("elixir"), env={"ELIXIR_CONFIG": OFFLOAD_PLAN})
    else:
        out = _elixir_run(ranks, str(SCRIPTS / "sequence.py"), *scripts("elixir"), "--elixir", OFFLOAD_PLAN)
    trainer_out, loop_out = out.split("== accelerate_loop.py")

    # the Trainer script: the engine ran (rank 0 alone printed its plan) on the weights streamed from
    # the folder the script's from_pretrained named, and logged the stock numbers
    assert trainer_out.count(PLAN_LINE) == 1 and re.search(rf"world size +{ranks}\n", trainer_out), out[-3000:]
    assert trainer_out.count(f"every rank fills its shards of the weights from {model_dir}") == 1, out[-3000:]
    for key in ("loss", "grad_norm", "eval_loss"):
        _close(_history(tmp_path / "elixir" / "trainer", key), _history(tmp_path / "stock" / "trainer", key), key)
    args = torch.load(tmp_path / "elixir" / "trainer" / "training_args.bin", weights_only=False)
    assert args.elixir_plugin.config.offload == 0.5 and args.elixir_plugin.config.n_blocks == "min"

    # the Accelerate loop: the stock losses, and every rank's optimizer file (by name) in its save_state
    assert loop_out.count(PLAN_LINE) == 1 and re.search(rf"world size +{ranks}\n", loop_out), out[-3000:]
    stock, ours = (json.loads((tmp_path / run / "loop" / "losses.json").read_text()) for run in ("stock", "elixir"))
    assert len(ours) == 24 // ranks
    _close(ours, stock, "loop loss")
    for rank in range(ranks):
        assert (tmp_path / "elixir" / "loop" / "state" / optim_file_name(rank, ranks)).is_file()
    assert not (tmp_path / "stock" / "loop" / "state" / optim_file_name(0, 1)).exists()


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
def test_a_hub_id_in_the_script_streams_from_the_cache(model_dir, tmp_path) -> None:
    """The script's ``AutoModelForCausalLM.from_pretrained("org/tiny-gpt2")``, offline, the model in
    ``HF_HUB_CACHE``: the engine fills its shards from the snapshot folder, nothing loads it whole."""
    cache = tmp_path / "hf-cache"
    snapshot = cache_snapshot(cache, "org/tiny-gpt2", model_dir)
    args = ["--model_name_or_path", "org/tiny-gpt2", *TRAINER_ARGS, "--max_steps", "2"]
    out = _elixir_run(
        1,
        str(SCRIPTS / "hf_trainer.py"),
        *args,
        *("--output_dir", str(tmp_path / "out"), "--elixir", OFFLOAD_PLAN),
        env={"HF_HUB_CACHE": str(cache)},
    )
    assert out.count(f"every rank fills its shards of the weights from {snapshot}") == 1, out[-3000:]
    assert "not streamed" not in out
    assert len(_history(tmp_path / "out", "loss")) == 2


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
def test_a_hub_id_offline_and_not_cached_stops_naming_the_download(tmp_path) -> None:
    """One message, no traceback: the id, the command that downloads it, the variable that keeps it offline."""
    cmd = [sys.executable, "-m", "elixir_hf.commands.run", str(SCRIPTS / "hf_trainer.py"), "--model_name_or_path"]
    cmd += ["org/absent", "--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "org/absent is not a local folder" in proc.stderr and "`hf download org/absent`" in proc.stderr
    assert "HF_HUB_OFFLINE" in proc.stderr


# --------------------------------------------------------------------------- TRL and PEFT

SFT_ARGS = [  # gradient_checkpointing and the other SFTConfig defaults left as TRL sets them
    *("--max_steps", "4", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--adam_epsilon", "1e-6"),
    *("--logging_steps", "1", "--max_length", "16", "--bf16", "false", "--use_cpu", "--report_to", "none"),
    *("--save_strategy", "no", "--seed", "0", "--disable_tqdm", "true"),
]


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
def test_trl_sft_with_a_lora_adapter(model_dir, tmp_path, monkeypatch) -> None:
    """TRL's SFTTrainer with a PEFT LoRA adapter (frozen base, trainable adapters) through elixir-run:
    the stock losses and grad norms, the stock adapter files, and the stock SFTConfig field by field."""
    script = SCRIPTS / "trl_sft.py"
    common = ["--model_name_or_path", str(model_dir), "--use_peft", "true", *SFT_ARGS]
    _stock(1, script, *common, "--output_dir", str(tmp_path / "stock"), monkeypatch=monkeypatch)
    out = _elixir_run(1, str(script), *common, "--output_dir", str(tmp_path / "elixir"), "--elixir", OFFLOAD_PLAN)

    assert out.count(PLAN_LINE) == 1, out[-3000:]
    assert "a PEFT adapter is added to a model whose weights were to be streamed" in out  # read on rank 0 instead
    for key in ("loss", "grad_norm"):
        _close(_history(tmp_path / "elixir", key), _history(tmp_path / "stock", key), key)
    files = {p.name for p in (tmp_path / "elixir").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    assert files == {p.name for p in (tmp_path / "stock").iterdir()} | {
        "elixir_plan.json",
        "elixir_run",
    }  # + the plan, the run
    ours, stock = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("elixir", "stock"))
    assert ours.keys() == stock.keys() and all("lora_" in k for k in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], stock[key], rtol=1e-5, atol=1e-6)

    ours, stock = (torch.load(tmp_path / d / "training_args.bin", weights_only=False) for d in ("elixir", "stock"))
    assert ours.elixir_plugin.config.offload == 0.5 and type(stock).__name__ == "SFTConfig"
    assert ours.gradient_checkpointing is True  # SFTConfig's default (TrainingArguments' is False)
    fields = {f.name for f in dataclasses.fields(stock)} - {"output_dir", "logging_dir"}
    differ = {f for f in fields if getattr(ours, f) != getattr(stock, f)}
    assert not differ, {f: (getattr(ours, f), getattr(stock, f)) for f in differ}


def test_help_and_version_are_elixir_runs_own_before_a_script(capsys) -> None:
    """The entry point users meet first: ``--help`` prints the usage and exits 0 (it used to say
    "name the script to run" and exit 1); after the script, ``--help`` is the script's."""
    from elixir_hf import __version__

    for flag in ("-h", "--help"):
        with pytest.raises(SystemExit) as exit_:
            main([flag])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: elixir-run [--elixir") and "ELIXIR_CONFIG" in out
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"elixir-run (elixir-hf) {__version__}\n"
    assert split_elixir(["train.py", "--help"]) == (None, ["train.py", "--help"])


def test_help_is_fast_and_in_a_users_words() -> None:
    """``--help`` and ``--version`` load neither torch nor transformers (they took 6-10 s), and the help
    names no module or function of the package (issue 50, 5)."""
    from elixir_hf import plugin
    from elixir_hf.commands import run

    code = (
        "import sys\nfrom elixir_hf.commands.run import main\nfor flag in ('--help', '--version'):\n"
        "    try:\n        main([flag])\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules), file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stderr.strip() == "[]", out.stderr
    assert out.stdout.startswith("usage: elixir-run") and "elixir-run (elixir-hf)" in out.stdout
    assert "``" not in run.HELP and not re.search(r"\b(patches|loading\.model|construct_elixir)\b", run.HELP)
    assert run.ENV_VAR == plugin.ENV_VAR
