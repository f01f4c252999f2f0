"""Order in which fetch units first run in forward, traced on fake tensors (no real memory).

Chunks are packed in this order so that a forward pass walks the chunks front to back. When the
model cannot run under fake tensors (data-dependent control flow), registration order is used,
which for HF causal LMs is nearly the same.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..units import Unit
from .fake import constant_scalar_draws

__all__ = ["trace_unit_order", "call_model"]

logger = logging.getLogger(__name__)


def call_model(model: nn.Module, batch: Any) -> Any:
    """Calls ``model`` the way a training loop would with ``batch`` (dict → kwargs, tuple → args)."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def trace_unit_order(model: nn.Module, units: list[Unit], example_batch: Any | None) -> list[int]:
    """Unit indices in first-call order; units never called in the traced forward come last, in
    registration order."""
    calls = _fake_forward_calls(model, units, example_batch) if example_batch is not None else None
    if calls is None:
        return [u.index for u in units]
    order = list(dict.fromkeys(calls))
    order += [u.index for u in units if u.index not in set(order)]
    return order


def _fake_forward_calls(model: nn.Module, units: list[Unit], batch: Any) -> list[int] | None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls: list[int] = []
    handles = [
        u.module.register_forward_pre_hook(lambda _m, _a, i=u.index: calls.append(i)) for u in units
    ]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, constant_scalar_draws(mode):
            state = {
                name: mode.from_tensor(t)
                for name, t in [
                    *model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False),
                ]
            }
            fake_batch = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
            with torch.no_grad():
                torch.func.functional_call(model, state, _as_args(fake_batch), _as_kwargs(fake_batch), strict=False)
    except Exception as exc:  # any model code we cannot run on fake tensors
        logger.info("fake-tensor trace failed (%s: %s); using registration order", type(exc).__name__, exc)
        return None
    finally:
        for h in handles:
            h.remove()
    return calls


def _as_args(batch: Any) -> tuple:
    if isinstance(batch, dict):
        return ()
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _as_kwargs(batch: Any) -> dict:
    return dict(batch) if isinstance(batch, dict) else {}
