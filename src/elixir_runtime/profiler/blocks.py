"""The model's stack of identical transformer blocks, and a temporary cut of it to ``k`` blocks.

Tracing a few blocks of a long stack keeps profiling time independent of depth;
[Note: block extrapolation] in ``timeline.py`` says how the rest is replayed. Blocks
count as identical only when nothing but their index tells them apart: same class, same
parameter and buffer names/shapes/dtypes, same plain attributes (a ``layer_idx`` equal to the
block's own index is allowed; an ``attention_type`` that alternates is not), and a uniform
``config.layer_types`` where the model has one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

__all__ = ["BlockStack", "find_block_stack", "truncated"]

_PLAIN = (bool, int, float, str, type(None))


@dataclass(eq=False)
class BlockStack:
    parent: nn.Module
    attr: str
    prefix: str
    blocks: list[nn.Module]


def find_block_stack(model: nn.Module) -> BlockStack | None:
    """The ``nn.ModuleList`` of identical blocks holding the most parameters, if any."""
    best: tuple[int, BlockStack] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or not name:
            continue
        blocks = list(module)
        if not all(_same(blocks[0], b, 0, i) for i, b in enumerate(blocks)):
            continue
        numel = sum(p.numel() for p in module.parameters())
        if best is None or numel > best[0]:
            parent_name, _, attr = name.rpartition(".")
            best = (numel, BlockStack(model.get_submodule(parent_name), attr, name, blocks))
    if best is None or not _uniform_layer_types(model):
        return None
    return best[1]


def _same(a: nn.Module, b: nn.Module, ia: int, ib: int) -> bool:
    if type(a) is not type(b):
        return False
    if [(n, p.shape, p.dtype, p.requires_grad) for n, p in a.named_parameters()] != [
        (n, p.shape, p.dtype, p.requires_grad) for n, p in b.named_parameters()
    ]:
        return False
    if [(n, t.shape, t.dtype) for n, t in a.named_buffers()] != [(n, t.shape, t.dtype) for n, t in b.named_buffers()]:
        return False
    subs_a, subs_b = list(a.named_modules()), list(b.named_modules())
    if [(n, type(m)) for n, m in subs_a] != [(n, type(m)) for n, m in subs_b]:
        return False
    for (_, ma), (_, mb) in zip(subs_a, subs_b):
        plain_a = {k: v for k, v in vars(ma).items() if isinstance(v, _PLAIN)}
        plain_b = {k: v for k, v in vars(mb).items() if isinstance(v, _PLAIN)}
        if plain_a.keys() != plain_b.keys():
            return False
        if any(plain_a[k] != plain_b[k] and (plain_a[k], plain_b[k]) != (ia, ib) for k in plain_a):
            return False
    return True


def _uniform_layer_types(model: nn.Module) -> bool:
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return not types or len(set(types)) == 1


@contextlib.contextmanager
def truncated(stack: BlockStack, k: int) -> Iterator[None]:
    """The model runs with only the first ``k`` blocks; restored on exit, whatever happens."""
    original = stack.parent._modules[stack.attr]
    stack.parent._modules[stack.attr] = nn.ModuleList(stack.blocks[:k])
    try:
        yield
    finally:
        stack.parent._modules[stack.attr] = original
