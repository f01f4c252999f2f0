"""Frozen parameters, parameters that get no gradient in a step, and eval forwards between
training steps, each checked against plain PyTorch.

Parity runs use Adam eps=1e-6: with eps=1e-8, Adam turns pure round-off gradients (e.g. GPT-2's
attention key bias, whose true gradient is 0) into lr-sized steps, so two correct runs that only
sum in a different order drift apart in those weights.

Semantics for a trainable parameter that gets no gradient in a step are torch's (``.grad`` stays
``None``, so AdamW skips it: no decay, no moment update, its own step count does not advance) and
DDP's with ``find_unused_parameters=True`` (a parameter used on some ranks only gets the average
with zeros from the others and is updated). The plain reference is plain torch; a 2-rank test
runs real DDP beside the engine. Every Adam kernel (torch reference, C++, Triton interpreted) and
plan shape (rCache min/max, offload 0/50/100 %) is covered.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import elixir_runtime as er
from elixir_runtime.runtime import device_lane
from helpers.dist import run_distributed
from helpers.models import MLPOutput, TinyMLP, make_batch, make_mlp_batch, tiny_gpt2, tiny_mlp

LR, WD, EPS, CLIP = 1e-2, 0.1, 1e-6, 1.0
CONFIG = dict(mode="static", n_blocks="min", offload=0.5)


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)


def _prepare(model: nn.Module, batch, **cfg):
    return er.prepare(model, _adamw(model), config=er.ElixirConfig(**{**CONFIG, **cfg}), example_batch=batch)


def _engine_step(model, opt, batch) -> float:
    loss = model(**batch).loss
    opt.backward(loss)
    opt.clip_grad_norm(CLIP)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _plain_step(model, opt, batches) -> list[float]:
    """One step on the average loss of ``batches`` (one per simulated rank); per-batch losses."""
    losses = []
    for b in batches:
        loss = model(**b).loss
        (loss / len(batches)).backward()
        losses.append(loss.item())
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return losses


def _assert_state_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


# --------------------------------------------------------------------------- (a) frozen params


def _freeze(model: nn.Module) -> list[str]:
    model.transformer.wpe.requires_grad_(False)
    model.transformer.h[0].requires_grad_(False)
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def test_frozen_params_parity() -> None:
    steps = 10
    batches = [make_batch(128, seed=s) for s in range(steps)]

    plain = tiny_gpt2(seed=0)
    frozen_names = _freeze(plain)
    assert len(frozen_names) > 5
    init = {k: v.clone() for k, v in plain.state_dict().items()}
    plain_opt = _adamw(plain)
    want = [_plain_step(plain, plain_opt, [b])[0] for b in batches]

    model = tiny_gpt2(seed=0)
    _freeze(model)
    model, opt = _prepare(model, batches[0])
    assert any(not c.trainable for c in model._elixir.runtime.layout.chunks), "frozen chunks expected"
    got = [_engine_step(model, opt, b) for b in batches]

    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)
    sd = model.state_dict()
    _assert_state_close(sd, plain.state_dict())
    for n in frozen_names:
        assert torch.equal(sd[n], init[n]), f"frozen {n} changed"
        assert not dict(model.named_parameters())[n].requires_grad
    # trainable weights did move
    assert not torch.equal(sd["transformer.h.1.mlp.c_fc.weight"], init["transformer.h.1.mlp.c_fc.weight"])


# --------------------------------------------------------------------------- (b) unused params


class SometimesMLP(TinyMLP):
    """``TinyMLP`` whose extra branch (on the first hidden layer) runs only when ``use_extra`` is
    set: dynamic control flow, so the recorded access trace is left and re-recorded."""

    use_extra = False

    def forward(self, x, labels=None):
        h = torch.relu(self.layers[0](x))
        extra = torch.tanh(self.unused(h)).square().mean() if self.use_extra else None
        for layer in self.layers[1:]:
            h = torch.relu(layer(h))
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits, labels)
        return MLPOutput(loss=loss if extra is None else loss + extra, logits=logits)


def _build_mlp(kind: str) -> TinyMLP:
    if kind == "never":
        return tiny_mlp(seed=0, unused_branch=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return SometimesMLP(unused_branch=True)


MLP_STEPS = 8


def _uses_extra(kind: str, step: int, micro: int, grad_accum: int) -> bool:
    """``sometimes``: in steps 1, 4, 7 only, and then only in the last micro-step."""
    return kind == "sometimes" and step % 3 == 1 and micro == grad_accum - 1


def _extra_steps(kind: str) -> int:
    return sum(_uses_extra(kind, s, 0, 1) for s in range(MLP_STEPS))


def _mlp_batch(step: int, micro: int, rank: int) -> dict:
    return make_mlp_batch(seed=100 * step + 10 * micro + rank)


def _plain_mlp_run(kind: str, world_size: int, grad_accum: int = 1) -> tuple[list[list[float]], dict, dict]:
    """Losses ``[micro-step][rank]``, weights and each parameter's AdamW step count."""
    model = _build_mlp(kind)
    opt = _adamw(model)
    losses = []
    for step in range(MLP_STEPS):
        for micro in range(grad_accum):
            model.use_extra = _uses_extra(kind, step, micro, grad_accum)
            row = []
            for r in range(world_size):
                loss = model(**_mlp_batch(step, micro, r)).loss
                (loss / (world_size * grad_accum)).backward()
                row.append(loss.item())
            losses.append(row)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    steps = {n: int(opt.state[p]["step"]) if p in opt.state else 0 for n, p in model.named_parameters()}
    return losses, model.state_dict(), steps


def _use_kernel(opt, kernel: str) -> None:
    """Swaps the engine's Adam kernels for ``kernel`` ("torch", "cpp" = the CPU default, "triton")."""
    from elixir_runtime.kernels.cpu_adam import CpuAdamKernel
    from elixir_runtime.kernels.kernel import TorchAdamKernel

    if kernel == "cpp":
        assert all(isinstance(k, CpuAdamKernel) for k in opt.kernels.values())
        return
    if kernel == "torch":
        make = TorchAdamKernel
    else:  # the caller set TRITON_INTERPRET=1
        from helpers.interpreted import interpreted_triton_adam

        make = lambda: interpreted_triton_adam().TritonAdamKernel(block=128)  # noqa: E731
    opt.kernels = {name: make() for name in opt.kernels}


def _engine_mlp_steps(model, opt, kind: str, steps: range, rank: int, grad_accum: int, kernel: str) -> list[float]:
    losses = []
    for step in steps:
        for micro in range(grad_accum):
            model.use_extra = _uses_extra(kind, step, micro, grad_accum)
            loss = model(**_mlp_batch(step, micro, rank)).loss
            opt.backward(loss / grad_accum)
            losses.append(loss.item())
        opt.clip_grad_norm(CLIP)
        opt.step()
        if kernel == "triton":  # the interpreter copies whole arenas out and back: no overlap
            model._elixir.runtime.host_updates.wait_all()
        opt.zero_grad()
    return losses


def _param_steps(model, opt) -> dict[str, int]:
    names = model._elixir.runtime.layout.names
    return {n: opt.param_steps[i] for i, ns in enumerate(names) for n in ns}


def _engine_mlp_run(
    rank: int,
    world_size: int,
    kind: str,
    n_blocks="min",
    offload=0.5,
    grad_accum: int = 1,
    kernel: str = "cpp",
    lane: bool = False,
) -> tuple[list[float], dict, dict]:
    """``lane``: the device update lane takes slices of offloaded chunks beside the CPU."""
    model = _build_mlp(kind)
    model, opt = _prepare(
        model, _mlp_batch(0, 0, rank), n_blocks=n_blocks, offload=offload, device_assisted_update=lane
    )
    assert (model._elixir.runtime.host_updates.lane is not None) == lane
    _use_kernel(opt, kernel)
    losses = _engine_mlp_steps(model, opt, kind, range(MLP_STEPS), rank, grad_accum, kernel)
    return losses, model.state_dict(), _param_steps(model, opt)


def _check_mlp(kind: str, world_size: int, results: list[tuple], grad_accum: int = 1) -> None:
    want_losses, want_state, want_steps = _plain_mlp_run(kind, world_size, grad_accum)
    init = _build_mlp(kind).state_dict()
    for rank, (losses, state, steps) in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor([s[rank] for s in want_losses]), rtol=0, atol=1e-6
        )
        _assert_state_close(state, want_state)
        assert steps == want_steps
    # the branch's weights moved exactly in the steps that gave them a gradient: never = untouched
    assert want_steps["unused.weight"] == _extra_steps(kind) and want_steps["head.weight"] == MLP_STEPS
    w0, w = init["unused.weight"], results[0][1]["unused.weight"]
    assert torch.equal(w, w0) == (kind == "never")


KERNELS = ["torch", "cpp", "triton"]
PLAN_SHAPES = [("min", 1.0), ("max", 0.0), ("min", 0.5)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_unused_branch_world1(kernel, monkeypatch) -> None:
    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    for n_blocks, offload in PLAN_SHAPES:
        for kind, grad_accum in (("never", 1), ("sometimes", 1), ("sometimes", 2)):
            run = _engine_mlp_run(0, 1, kind, n_blocks, offload, grad_accum, kernel)
            _check_mlp(kind, 1, [run], grad_accum)


@pytest.mark.parametrize("offload", [0.5, 1.0])
def test_unused_branch_device_lane(offload, monkeypatch) -> None:
    """The lane's slices follow the used parameters' ranges and their own step counts."""
    monkeypatch.setattr(device_lane, "LANE_SLICE", LANE_SLICE)
    for kind, grad_accum in (("never", 1), ("sometimes", 2)):
        run = _engine_mlp_run(0, 1, kind, "min", offload, grad_accum, lane=True)
        _check_mlp(kind, 1, [run], grad_accum)


def test_per_parameter_step_counts_survive_a_checkpoint() -> None:
    """Saved after step 5 (the branch took 2 steps, the rest 5) and resumed in a fresh engine: the
    branch's bias correction at step 7 must use its own count, as the uninterrupted torch run."""
    model, opt = _prepare(_build_mlp("sometimes"), _mlp_batch(0, 0, 0))
    _engine_mlp_steps(model, opt, "sometimes", range(5), 0, 1, "cpp")
    state, opt_state = model.state_dict(), opt.state_dict()
    assert _param_steps(model, opt)["unused.weight"] == 2 and opt.step_count == 5

    model, opt = _prepare(_build_mlp("sometimes"), _mlp_batch(0, 0, 0))
    model.load_state_dict(state)
    opt.load_state_dict(opt_state)
    _engine_mlp_steps(model, opt, "sometimes", range(5, MLP_STEPS), 0, 1, "cpp")
    _, want_state, want_steps = _plain_mlp_run("sometimes", 1)
    _assert_state_close(model.state_dict(), want_state)
    assert _param_steps(model, opt) == want_steps


WORLD2_CASES = [
    *((n_blocks, kind, ga, False) for n_blocks in ("min", "max") for kind, ga in (("never", 1), ("sometimes", 2))),
    ("min", "sometimes", 2, True),  # with the device update lane
]
LANE_SLICE = 256
"""Elements per device-lane slice in these tests: every offloaded chunk is cut into several."""


def _world2_runs(rank: int, world_size: int) -> list:
    device_lane.LANE_SLICE = LANE_SLICE  # in this spawned rank
    return [
        _engine_mlp_run(rank, world_size, kind, n_blocks, grad_accum=ga, lane=lane)
        for n_blocks, kind, ga, lane in WORLD2_CASES
    ]


def test_unused_branch_world2() -> None:
    # "min": the rCache holds only the largest unit, so chunks must be reduced (and their blocks
    # freed) during the backward even though the unused branch's chunks never complete
    results = run_distributed(_world2_runs, 2, timeout=180)
    for i, (_, kind, ga, _) in enumerate(WORLD2_CASES):
        _check_mlp(kind, 2, [r[i] for r in results], ga)


class RankMLP(TinyMLP):
    """Runs its extra branch on every rank (its unit runs everywhere, so gathers stay in step) but
    adds it to the loss only where ``use_extra`` is set: parameters that get a gradient on some
    ranks only. ``late``: the branch reads the last hidden layer, so on the ranks that use it its
    gradients arrive first in backward rather than last."""

    use_extra = False
    late = False

    def forward(self, x, labels=None):
        h = torch.relu(self.layers[0](x))
        extra = None if self.late else torch.tanh(self.unused(h)).square().mean()
        for layer in self.layers[1:]:
            h = torch.relu(layer(h))
        if self.late:
            extra = torch.tanh(self.unused(h)).square().mean()
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits, labels)
        return MLPOutput(loss=loss + extra if self.use_extra else loss, logits=logits)


def _rank_mlp(late: bool) -> RankMLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = RankMLP(unused_branch=True)
    model.late = late
    return model


def _rank_uses_extra(rank: int, step: int) -> bool:
    return rank == 0 and step % 3 == 1


def _ddp_and_engine(rank: int, world_size: int, late: bool, chunk_size: int | None, n_blocks="min") -> tuple:
    """The same run under DDP(find_unused_parameters=True) and under the engine, on this rank."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_rank_mlp(late), find_unused_parameters=True)
    opt = _adamw(ddp)
    for step in range(MLP_STEPS):
        ddp.module.use_extra = _rank_uses_extra(rank, step)
        ddp(**_mlp_batch(step, 0, rank)).loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.grad is not None], CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    want = ddp.module.state_dict()

    model, eopt = _prepare(_rank_mlp(late), _mlp_batch(0, 0, rank), chunk_size=chunk_size, n_blocks=n_blocks)
    n_chunks = sum(c.trainable for c in model._elixir.runtime.layout.chunks)
    try:
        for step in range(MLP_STEPS):
            model.use_extra = _rank_uses_extra(rank, step)
            _engine_step(model, eopt, _mlp_batch(step, 0, rank))
    except RuntimeError as err:
        return want, n_chunks, str(err)
    return want, n_chunks, model.state_dict()


def _ddp_then_order_mismatch(rank: int, world_size: int) -> tuple:
    """One chunk (every order agrees), then a chunk per layer with the branch's gradients first."""
    return _ddp_and_engine(rank, world_size, False, 1 << 20), _ddp_and_engine(rank, world_size, True, None, "max")


def test_param_used_on_some_ranks_matches_ddp() -> None:
    """Used on rank 0 only, in steps 1, 4, 7: DDP averages rank 0's gradient with zeros from rank
    1 and updates the parameter (in those steps only); so does the engine. With several chunks,
    a branch whose gradients arrive early makes the ranks reduce chunks in different orders:
    the engine then fails on every rank, naming the parameter, instead of mixing up chunks."""
    results = run_distributed(_ddp_then_order_mismatch, 2, timeout=120)
    init = _rank_mlp(False).state_dict()
    for (want, n_chunks, got), _ in results:
        assert n_chunks == 1
        _assert_state_close(got, want)
    assert not torch.equal(want["unused.weight"], init["unused.weight"])
    torch.testing.assert_close(results[0][0][2], results[1][0][2], rtol=0, atol=0)
    for _, (_, n_chunks, got) in results:
        assert n_chunks > 1
        assert isinstance(got, str) and "different orders" in got and "unused.weight" in got, got


class ReuseMLP(TinyMLP):
    """Calls ``layers[0]`` a second time, on the raw input (no grad-requiring input), for an extra
    branch through ``unused``: a unit whose backward runs early and whose inputs need no grad."""

    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        extra = torch.tanh(self.unused(torch.relu(self.layers[0](x)))).square().mean()
        return MLPOutput(loss=out.loss + extra, logits=out.logits)


def _reuse_mlp() -> ReuseMLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ReuseMLP(unused_branch=True)


def test_unit_called_twice_trains_with_min_rcache() -> None:
    batches = [make_mlp_batch(seed=s) for s in range(4)]
    plain = _reuse_mlp()
    plain_opt = _adamw(plain)
    want = [_plain_step(plain, plain_opt, [b])[0] for b in batches]

    model, opt = _prepare(_reuse_mlp(), batches[0], n_blocks="min")
    got = [_engine_step(model, opt, b) for b in batches]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)
    _assert_state_close(model.state_dict(), plain.state_dict())


# --------------------------------------------------------------------------- (c) eval between steps


def test_eval_forward_between_steps_keeps_parity() -> None:
    steps = 10
    batches = [make_batch(128, seed=s) for s in range(steps)]
    eval_batch = make_batch(128, batch=3, seq=12, seed=999)

    def evaluate(model) -> list[float]:
        out = []
        with torch.no_grad():
            model.eval()
            out.append(model(**eval_batch).loss.item())
            model.train()
            out.append(model(**eval_batch).loss.item())  # no-grad forward in train mode: another kind
        return out

    plain = tiny_gpt2(seed=0)
    plain_opt = _adamw(plain)
    want, want_eval = [], []
    for s, b in enumerate(batches):
        want += _plain_step(plain, plain_opt, [b])
        if s % 3 == 0:
            want_eval += evaluate(plain)

    model, opt = _prepare(tiny_gpt2(seed=0), batches[0])
    got, got_eval = [], []
    for s, b in enumerate(batches):
        got.append(_engine_step(model, opt, b))
        if s % 3 == 0:
            got_eval += evaluate(model)

    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got_eval), torch.tensor(want_eval), rtol=0, atol=1e-6)
    _assert_state_close(model.state_dict(), plain.state_dict())
