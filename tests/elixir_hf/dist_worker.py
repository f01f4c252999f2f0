"""Run under ``torchrun --nproc_per_node 2`` (CPU, gloo) by ``test_distributed.py``.

On every rank: a stock DDP Trainer run, the same run through ElixirTrainer (saving a checkpoint
half-way and the final model), a resume from that checkpoint, the Elixir run again from the
same initial weights saved to disk and loaded by ``elixir_hf.from_pretrained`` with ``stream=False``
(rank 1 builds the model on meta), a resume of a model streamed from them (every rank on meta), and a plain ElixirAccelerator loop with rank 1's model built on meta or not. Rank 0 writes what the test compares to ``<out>/result.json``.
The runs differ in ``--log_level``/``--log_level_replica``/``--disable_tqdm``: what each showed on
each rank's stderr (Elixir's INFO lines, its progress bars) is in the result too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import logging
import os
import re
import signal
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from hf_cases import OFFLOAD_PLAN, VOCAB, TokenDataset, history, make_trainer, training_args  # noqa: E402

import elixir_hf  # noqa: E402
from helpers.lifetime import die_with_parent  # noqa: E402
from helpers.models import ATTN_IMPL, MODEL_BUILDERS  # noqa: E402

die_with_parent()  # torchrun: a rank never outlives it

STEPS = 8
PROMPT = torch.tensor([[5, 17, 3, 9], [8, 8, 40, 2]])
# the test's timeout asks for every thread's stack, one file per rank (stderr's tail would cut them)
_STACKS = open(os.path.join(sys.argv[1], f"stacks-rank{os.environ.get('RANK', '0')}.txt"), "w")
faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)


class _Tee(io.TextIOBase):
    """This rank's stdout, also kept in ``text`` to count what was shown."""

    def __init__(self, stream) -> None:
        self.stream, self.text = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.text.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()


def _shown(err: _Tee, since: int) -> dict:
    """What this rank's stderr showed since offset ``since``: Elixir's INFO lines and its bars (lines
    here: this stderr is not a terminal, elixir_hf/console.py)."""
    text = err.text.getvalue()[since:]
    return {
        "plan": text.count("Elixir plan for"),
        "lean_loss": text.count("ForCausalLMLoss replaced"),
        "bars": sorted(set(re.findall(r"^(elixir: [a-z' ]+[a-z])", text, re.M))),
    }


def main(out: str) -> None:
    sys.stdout = tee = _Tee(sys.stdout)
    sys.stderr = err = _Tee(sys.stderr)  # tqdm's bars
    for handler in hf_logging.get_logger("transformers").handlers:
        handler.setStream(err)
    logging.basicConfig(level=logging.INFO, stream=tee)
    shown = {}
    common = dict(max_steps=STEPS, eval_steps=4, ddp_backend="gloo", ddp_timeout=120)
    ddp = make_trainer("gpt2", training_args(f"{out}/ddp", **common))
    ddp.train()
    ddp.save_model(f"{out}/ddp_final")

    elixir_args = dict(save_strategy="steps", save_steps=STEPS // 2, **common)
    since = len(err.text.getvalue())
    full = make_trainer(
        "gpt2", training_args(f"{out}/elixir", OFFLOAD_PLAN, **elixir_args, log_level="info", disable_tqdm=False)
    )
    sampler = elixir_hf.GenerateCallback(
        PROMPT, every_n_steps=STEPS // 2, max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    full.add_callback(sampler)  # rank 0 generates alone mid-training; the losses must still match DDP
    full.train()
    full.save_model(f"{out}/elixir_final")
    shown["info"], since = _shown(err, since), len(err.text.getvalue())

    resumed = make_trainer(
        "gpt2", training_args(f"{out}/elixir", OFFLOAD_PLAN, **elixir_args, log_level="warning", disable_tqdm=False)
    )
    resumed.train(resume_from_checkpoint=f"{out}/elixir/checkpoint-{STEPS // 2}")
    shown["warning"] = _shown(err, since)

    if dist.get_rank() == 0:
        MODEL_BUILDERS["gpt2"](seed=0, vocab=VOCAB).save_pretrained(f"{out}/init")
    dist.barrier()
    loaded = elixir_hf.from_pretrained(
        AutoModelForCausalLM, f"{out}/init", stream=False, dtype=torch.float32, attn_implementation=ATTN_IMPL
    )
    on_meta: list = [None] * dist.get_world_size()
    dist.all_gather_object(on_meta, all(p.is_meta for p in loaded.parameters()))
    since = len(err.text.getvalue())
    from_rank0 = make_trainer(
        loaded, training_args(f"{out}/from_rank0", OFFLOAD_PLAN, **common, log_level="info", log_level_replica="info")
    )
    from_rank0.train()
    shown["replica_info"] = _shown(err, since)
    # streamed (every rank on meta), then resumed: every rank reads its shards of the checkpoint's weights
    loaded = elixir_hf.from_pretrained(
        AutoModelForCausalLM, f"{out}/init", dtype=torch.float32, attn_implementation=ATTN_IMPL
    )
    streamed: list = [None] * dist.get_world_size()
    dist.all_gather_object(streamed, all(p.is_meta for p in loaded.parameters()))
    from_rank0_resumed = make_trainer(loaded, training_args(f"{out}/elixir", OFFLOAD_PLAN, **elixir_args))
    from_rank0_resumed.train(resume_from_checkpoint=f"{out}/elixir/checkpoint-{STEPS // 2}")

    hf_logging.set_verbosity_info()  # on every rank, as TRANSFORMERS_VERBOSITY=info would
    since = len(err.text.getvalue())
    accelerate_runs = [_accelerate_loop(meta_ranks) for meta_ranks in (False, True)]
    shown["accelerate_info"] = _shown(err, since)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shown)

    if dist.get_rank() == 0:
        result = {
            "world_size": dist.get_world_size(),
            "shown": everyone,
            "ddp": {k: history(ddp, k) for k in ("loss", "grad_norm", "eval_loss")},
            "elixir": {k: history(full, k) for k in ("loss", "grad_norm", "eval_loss")},
            "resumed": {k: history(resumed, k) for k in ("loss", "grad_norm", "eval_loss")},
            "loaded_on_meta": on_meta,
            "streamed_on_meta": streamed,
            "from_rank0_resumed": {k: history(from_rank0_resumed, k) for k in ("loss", "grad_norm", "eval_loss")},
            "from_rank0": {k: history(from_rank0, k) for k in ("loss", "grad_norm", "eval_loss")},
            "accelerate": [losses for losses, _ in accelerate_runs],
            "samples": [(step, ids.tolist()) for step, ids in sampler.samples],
            "accelerate_weight_diff": max(
                (accelerate_runs[0][1][k] - accelerate_runs[1][1][k]).abs().max().item() for k in accelerate_runs[0][1]
            ),
        }
        with open(f"{out}/result.json", "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()  # without it a gloo run with several Trainers can abort at exit
    _exit_now()  # before this frame's locals (the Trainers) are freed


def _accelerate_loop(meta_ranks: bool) -> tuple[list[float], dict]:
    """A plain ElixirAccelerator loop; with ``meta_ranks`` rank 1 builds the model on meta."""
    accelerator = elixir_hf.ElixirAccelerator(elixir_plugin=OFFLOAD_PLAN, cpu=True, gradient_accumulation_steps=2)
    with torch.device("meta") if meta_ranks and accelerator.process_index > 0 else contextlib.nullcontext():
        model = MODEL_BUILDERS["gpt2"](seed=0, vocab=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(TokenDataset(24), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _exit_now() -> None:
    """Ends the rank without freeing Python objects. Freeing the stock DDP Trainer's reducer destroys
    its gloo process group, whose destructor joins a worker thread that needs the GIL the joining
    thread holds: an occasional hang in torch's teardown (py-spy: ~ProcessGroupGloo → thread::join,
    the thread in decref_pyobject waiting for the GIL), not in the engine."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
