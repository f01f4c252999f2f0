"""The held block inputs as a plan choice (``planner._search_activations``): on a GPU whose memory the held
inputs crowd, ``auto`` puts them on the host, where the model's states then fit, and says what the GPU tier
would have given; a forced tier is kept; host memory too small and a step without checkpointing are refused
at planning, naming the numbers and the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from search_cases import GIB, gpu_host, model_state_bytes

import elixir_runtime as er
import elixir_runtime.planner as planner
import elixir_runtime.search.loop as loop
from elixir_runtime.config import ConfigError
from elixir_runtime.plan_view import plan_table
from elixir_runtime.profiler.profile import ModelProfile
from elixir_runtime.search import Budget
from elixir_runtime.search.step_time import with_held_copies
from elixir_runtime.units import find_units
from helpers.models import make_batch, tiny_llama

N_LAYER = 6


def _model(ac: bool = True) -> torch.nn.Module:
    model = tiny_llama(n_layer=N_LAYER, n_embd=64, n_positions=1024)
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _plan(model: torch.nn.Module, host_gib: float = 64, **config: object) -> planner.Planned:
    """Planned for a CUDA rank whose GPU holds the states with the held inputs away, not with them."""
    states = model_state_bytes(model)

    def budget(profile: ModelProfile) -> Budget:
        capacity = int(1.25 * profile.host_activation_peak + profile.buffer_bytes + 1.2 * states / 0.98)
        return Budget(capacity, profile.activation_peak, profile.buffer_bytes, int(host_gib * GIB), 1)

    target = planner.Target(1, gpu_host(), budget)
    batch = make_batch(128, batch=4, seq=1024, device=torch.device("cpu"))
    cfg = er.ElixirConfig(**config)  # type: ignore[arg-type]
    job = planner.PlanJob(model, find_units(model, None), batch, cfg, torch.device("cuda"), torch.float32)
    return planner.plan_model(job, target)


def test_auto_puts_them_on_the_host_where_the_states_then_fit() -> None:
    plan = _plan(_model()).plan
    assert plan.profile is not None and plan.search is not None and plan.predicted is not None
    held = plan.profile.held_inputs
    assert held == N_LAYER * 4 * 1024 * 64 * 4
    assert plan.activations == "host" and not plan.offload
    assert plan.memory.host_activations == held and plan.host_bytes == held
    assert plan.memory.activations == plan.profile.host_activation_peak < plan.profile.activation_peak
    (device,) = plan.search.activations
    assert device.where == "device" and device.offloaded and device.step_s > plan.predicted.total
    text = plan_table(plan)
    assert "host: the held block inputs" in text and "on the GPU: " in text


def test_a_forced_tier_is_kept_and_the_other_not_searched() -> None:
    plan = _plan(_model(), activations="device").plan
    assert plan.activations == "device" and plan.offload and not plan.search.activations
    assert not plan.memory.host_activations
    again = er.ElixirPlan.from_json(plan.to_json())
    assert again.activations == "device" and again.settings()["activations"] == "device"


def test_the_copies_are_priced_beside_compute() -> None:
    """The held inputs' copies go on the host link's transfers; where the link has room under compute they
    cost no time, else what they need beyond it."""
    t = dataclasses.replace(_plan(_model()).plan.predicted, h2d=0.1, d2h=0.1, compute=1.0)
    rates = gpu_host().rates(1)
    room = with_held_copies(t, int(0.2 * rates.h2d), rates)
    assert room.total == t.total and room.h2d == pytest.approx(0.3)
    tight = with_held_copies(t, int(0.5 * rates.h2d), rates)
    assert tight.total == pytest.approx(t.total + 0.2 + 0.5 + 0.5 - 1.0, rel=1e-6)


def test_bad_tiers_are_refused_at_planning() -> None:
    with pytest.raises(er.PlanError, match=r"held block inputs need .*\(activations 'device'\)"):
        _plan(_model(), host_gib=0.001, activations="host")
    with pytest.raises(er.PlanError, match="activation checkpointing is off"):
        _plan(_model(ac=False), activations="host")
    with pytest.raises(ConfigError, match="activations"):
        er.ElixirConfig(activations="cpu")  # type: ignore[arg-type]


def test_a_plan_s_searches_lay_out_each_chunk_size_once(monkeypatch) -> None:
    """Both tiers (and the moments priced beside them) are searched on the same layouts (``loop.Layouts``):
    each chunk size (of an alignment: 8-bit moments align to their blocks) is laid out, traced and simulated
    once per plan."""
    built, searched = [], []
    build, search = loop.build_layout, planner.search
    monkeypatch.setattr(
        loop, "build_layout", lambda *a, **kw: built.append((kw["chunk_size"], kw["alignment"])) or build(*a, **kw)
    )
    monkeypatch.setattr(planner, "search", lambda *a, **kw: searched.append(a[3]) or search(*a, **kw))
    plan = _plan(_model()).plan
    assert len(searched) >= 2 and {b.host_activations for b in searched} == {0, plan.profile.held_inputs}
    assert built and sorted(built) == sorted(set(built))
