"""Order in which fetch units first run in forward, and the parameters the forward reads outside
them (``outside.py``), traced on fake tensors (no real memory).

Chunks are packed in this order so that a forward pass walks the chunks front to back. The forward
runs in ``fake.fake_run``, as the profiler's step does, so both see the same model (training mode,
compute dtype and device). When the model cannot run under fake tensors (data-dependent control
flow), registration order is used, which for HF causal LMs is nearly the same.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn

from ..units import Unit
from .fake import fake_run
from .outside import OutsideReads

__all__ = ["UnitTrace", "trace_unit_order", "call_model"]

logger = logging.getLogger(__name__)


def call_model(model: nn.Module, batch: object) -> Any:  # what the model returns
    """Calls ``model`` the way a training loop would with ``batch`` (dict → kwargs, tuple → args)."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class UnitTrace(NamedTuple):
    order: list[int]
    """Unit indices in first-call order, the never-called ones last."""
    read_outside: list[str]
    """Parameters the forward read while no unit holding them ran (``outside.py``)."""


def trace_unit_order(
    model: nn.Module, units: list[Unit], example_batch: object | None, dtype: torch.dtype, device: torch.device
) -> UnitTrace:
    """A forward of ``example_batch`` on fake tensors (``dtype`` and ``device``: the run's compute
    dtype and device, as the profiler traces the step); without a batch, or if the model cannot run
    on fakes, registration order and nothing found outside."""
    traced = _fake_forward(model, units, example_batch, dtype, device) if example_batch is not None else None
    if traced is None:
        return UnitTrace([u.index for u in units], [])
    calls, outside = traced
    order = list(dict.fromkeys(calls))
    order += [u.index for u in units if u.index not in set(order)]
    return UnitTrace(order, outside)


def _fake_forward(
    model: nn.Module, units: list[Unit], batch: object, dtype: torch.dtype, device: torch.device
) -> tuple[list[int], list[str]] | None:
    calls: list[int] = []
    handles = [u.module.register_forward_pre_hook(lambda _m, _a, i=u.index: calls.append(i)) for u in units]
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        with fake_run(model, batch, dtype, device) as fake, torch.no_grad():
            outside = OutsideReads(units, fake.params, names)
            with outside.watching():
                call_model(model, fake.batch)
    except Exception as exc:  # any model code we cannot run on fake tensors
        logger.info("fake-tensor trace failed (%s: %s); using registration order", type(exc).__name__, exc)
        return None
    finally:
        for h in handles:
            h.remove()
    return calls, list(outside.found)
