"""Forwards on some ranks only: the supported way (``full_params``) works, the unsupported ways
fail on every rank within seconds, naming the cause and the fix.

Measured before: rank 0 running one extra no-grad forward (rCache min) hung both ranks until the
30-minute process-group timeout; a rank one training step ahead had its collectives paired with
the other rank's save unnoticed."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import elixir_runtime as er
from elixir_runtime.distributed import heartbeat
from elixir_runtime.distributed.heartbeat import EXIT_STALLED
from helpers.dist import DistributedError, run_distributed
from helpers.models import make_batch, tiny_gpt2

VOCAB = 128
CONFIG = dict(mode="static", n_blocks="min", offload=0.5, device="cpu")
PROMPT = torch.tensor([[5, 17, 3, 9], [8, 8, 40, 2]])


def _prepared(**config):
    model = tiny_gpt2(vocab=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return er.prepare(model, optimizer, er.ElixirConfig(**{**CONFIG, **config}), example_batch=make_batch(VOCAB))


def _step(model, optimizer, rank: int, step: int) -> float:
    loss = model(**make_batch(VOCAB, seed=100 * step + rank)).loss
    optimizer.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _generate(model, max_new_tokens: int = 6) -> torch.Tensor:
    return model.generate(
        PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )


def _failure(fn) -> tuple[str, float]:
    """What ``fn`` raised (it must raise LockstepError) and after how many seconds."""
    start = time.monotonic()
    try:
        fn()
    except er.LockstepError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("the rank-local operation was not detected")


# --------------------------------------------------------------------------- the 2-rank scenarios


def _extra_no_grad_forward(rank: int):
    model, optimizer = _prepared()
    _step(model, optimizer, rank, 0)

    def rest():
        if rank == 0:  # e.g. a quick evaluation on the main process
            with torch.no_grad():
                model(**make_batch(VOCAB))
        _step(model, optimizer, rank, 1)

    return _failure(rest)


def _extra_training_step_then_save(rank: int):
    model, optimizer = _prepared()

    def rest():
        for step in range(3 if rank == 0 else 2):  # rank 0 got one batch more
            _step(model, optimizer, rank, step)
        with er.rank0_state_dict(model):
            model.state_dict()

    return _failure(rest)


def _plain_generate(state: dict, max_new_tokens: int) -> torch.Tensor:
    plain = tiny_gpt2(vocab=VOCAB)
    plain.load_state_dict(state)
    return _generate(plain.eval(), max_new_tokens)


def _generate_inside_full_params(rank: int, rank0_only: bool):
    model, optimizer = _prepared()
    _step(model, optimizer, rank, 0)
    with er.rank0_state_dict(model):
        state = model.state_dict()
    out = refused = None
    model.eval()
    with er.full_params(model, rank0_only=rank0_only):
        if rank == 0 or not rank0_only:
            out = _generate(model, 6 + 3 * rank)  # different lengths: no collective may run inside
        else:
            try:
                model(**make_batch(VOCAB))
            except RuntimeError as exc:
                refused = str(exc)
    model.train()
    loss = _step(model, optimizer, rank, 1)  # the engine is back in step on both ranks
    want = _plain_generate(state, 6) if rank == 0 else None
    return out, want, refused, loss


def _forward_nobody_joins(rank: int):
    model, optimizer = _prepared(lockstep_timeout_s=1.0)
    _step(model, optimizer, rank, 0)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        with torch.no_grad():
            failure = _failure(lambda: model(**make_batch(VOCAB)))
        store.set("rank 0 gave up", "1")
        return failure
    store.wait(["rank 0 gave up"])  # rank 1 is busy elsewhere; when it comes back, rank 0 has given up
    return _failure(lambda: _step(model, optimizer, rank, 1))


def _scenarios(rank: int, _world: int) -> dict:
    """One pair of processes runs every scenario (spawning them costs more than the scenarios)."""
    return {
        "extra_forward": _extra_no_grad_forward(rank),
        "extra_step": _extra_training_step_then_save(rank),
        "rank0_only": _generate_inside_full_params(rank, True),
        "every_rank": _generate_inside_full_params(rank, False),
        "nobody_joins": _forward_nobody_joins(rank),  # last: it leaves the ranks out of step
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_scenarios, 2, timeout=300)


def test_extra_no_grad_forward_on_rank_0_fails_on_both_ranks_naming_cause_and_fix(two_ranks) -> None:
    for result in two_ranks:
        message, seconds = result["extra_forward"]
        assert "rank 0 starts a no-grad forward (operation #1); rank 1 starts a forward with grad enabled" in message
        assert "elixir_runtime.full_params(model)" in message and "synced_gpus=True" in message
        assert seconds < 60


def test_an_extra_training_step_on_one_rank_is_detected(two_ranks) -> None:
    for result in two_ranks:
        assert (
            "rank 0 starts a forward with grad enabled (operation #2); rank 1 starts state_dict() (gathering the "
            "weights) (operation #2)" in result["extra_step"][0]
        )


def test_a_forward_nobody_joins_fails_after_the_timeout_on_every_rank(two_ranks) -> None:
    (first, waited), (second, _) = (r["nobody_joins"] for r in two_ranks)
    assert (
        "rank 0 started a no-grad forward (its operation #1) and the other ranks did not start one within 1 s" in first
    )
    assert "lockstep_timeout_s" in first and 1 <= waited < 30
    assert "rank 0 start" in second and "full_params" in second  # rank 0's entry, or the reason it posted


@pytest.mark.parametrize("case", ["rank0_only", "every_rank"])
def test_full_params_lets_ranks_generate_alone_and_matches_a_plain_model(two_ranks, case: str) -> None:
    (out0, want, _, loss0), (out1, _, refused, loss1) = (r[case] for r in two_ranks)
    assert torch.equal(out0, want), (out0, want)
    assert out0.shape == (2, 4 + 6)
    if case == "rank0_only":
        assert out1 is None and "rank 0 only" in refused
    else:
        assert out1.shape == (2, 4 + 9)
    assert loss0 != loss1  # both trained on after the context, each on its own batch


def test_full_params_on_one_process_matches_a_plain_model() -> None:
    model, optimizer = _prepared()
    _step(model, optimizer, 0, 0)
    state = model.state_dict()
    with er.full_params(model) as inside:
        assert inside is model and not torch.is_grad_enabled()
        out = _generate(model.eval())
    assert torch.equal(out, _plain_generate(state, 6))
    assert all(0 in p.stride() for p in model.parameters())  # placeholders again: nothing kept resident
    _step(model.train(), optimizer, 0, 1)


# --------------------------------------------------------------------------- the rank that ran ahead


def _ran_ahead_into_the_step(rank: int, _world: int):
    """Rank 0 runs an extra no-grad forward before its step; rank 1 is already in the step's
    gradient-norm all-reduce (an engine collective on the main group, not a check-in)."""
    model, optimizer = _prepared(lockstep_timeout_s=1.0)
    dist.barrier()  # the 1 s check-ins start together, on a loaded machine too
    _step(model, optimizer, rank, 0)
    dist.barrier()

    def rest():
        loss = model(**make_batch(VOCAB, seed=rank)).loss
        optimizer.backward(loss)
        if rank == 0:
            with torch.no_grad():
                model(**make_batch(VOCAB))
        optimizer.step()

    return _failure(rest)  # rank 0 gives up after 1 s; rank 1 must not wait for its process to end


def test_the_rank_that_ran_ahead_gets_the_same_error_not_a_transport_error() -> None:
    (first, waited), (second, released) = run_distributed(_ran_ahead_into_the_step, 2, timeout=300)
    cause = "rank 0 started a no-grad forward (its operation #2) and the other ranks did not start one within 1 s"
    assert cause in first and 1 <= waited < 30 and released < 30
    assert second.startswith(first), second
    assert "raised on this rank too: this rank's engine collective failed when that rank gave up" in second


def _waits_where_no_abort_reaches(rank: int, _world: int):
    """As on NCCL, whose collectives a peer's abort does not release (the beat told so): rank 0 runs
    a forward alone and gives up after 1 s while rank 1 waits, inside a step, on a store key nobody
    sets (``distributed/heartbeat.py``, [Note: waits nothing releases])."""
    model, optimizer = _prepared(lockstep_timeout_s=1.0)
    heartbeat._beat.releasable = False
    _step(model, optimizer, rank, 0)
    if rank == 0:
        with torch.no_grad():
            return _failure(lambda: model(**make_batch(VOCAB)))
    with heartbeat.armed():
        dist.distributed_c10d._get_default_store().wait(["nobody sets this"])


def test_a_rank_no_abort_releases_ends_with_the_posted_error() -> None:
    """Rank 0 raises its ``LockstepError``; rank 1, whose wait nothing releases, ends its process with
    exit status 69 (printing the same message) instead of waiting for the store's 5-minute timeout."""
    with pytest.raises(DistributedError) as failed:
        run_distributed(_waits_where_no_abort_reaches, 2, timeout=120)
    report = str(failed.value)
    assert report.startswith("1 failure(s)") and f"--- rank 1 ---\nexited with code {EXIT_STALLED} " in report, report
