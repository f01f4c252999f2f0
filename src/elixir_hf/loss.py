"""A causal-LM cross-entropy that leaves the logits in the compute dtype, installed in place of
transformers' ``ForCausalLMLoss`` (``ElixirPlugin.lean_loss``, on by default).

transformers' loss upcasts the whole logits tensor (``logits.float()``), ``cross_entropy`` saves
its fp32 log-softmax for backward, and backward materialises fp32 gradients: three fp32 copies of
the logits at once. ``lean_causal_lm_loss`` computes the same value in fp32 a block of rows at a
time (``BLOCK_BYTES``), keeps for backward only the logits (alive anyway: the lm_head's output)
and the targets, and writes the gradient block by block into one tensor in the logits' dtype: its
peak is the logits, their gradient and three fp32 blocks. What it saves: docs/hf.md, "What
changes underneath, and why".

The semantics are transformers' (``ForCausalLMLoss`` + ``fixed_cross_entropy``, the same in 5.17
and 5.24): labels shifted left with ``ignore_index`` padded at the end unless ``shift_labels`` is
given, rows labelled ``ignore_index`` left out, the sum divided by ``num_items_in_batch`` (tensor
or int) when given, else the mean over the kept rows (NaN when none is kept, as torch gives), an
fp32 result. The loss agrees to fp32 rounding (the sum over rows runs in another order), the
gradient to the bit on CPU (``_CrossEntropySum``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["lean_causal_lm_loss", "use_lean_loss"]

logger = logging.getLogger(__name__)

BLOCK_BYTES = 128 * 2**20
"""fp32 bytes of one block of rows at most: at most 3 such temporaries are alive at once
(backward's log-softmax, its incoming gradient and its result), 384 MiB; smaller blocks would only
add kernel launches."""

MIN_BLOCKS = 8
"""Blocks at least, however few the rows: 3 blocks then hold at most 3/8 of an fp32 copy of the
logits, so that the lean loss's backward (logits + their gradient + 3 blocks: 1.4 fp32 copies in
bf16, 2.4 in fp32) stays below the stock one's (3 fp32 copies) at any size; with one block a
small batch would peak higher than the stock loss, by the logits it keeps."""


def _block_rows(rows: int, vocab: int) -> int:
    return max(1, min(BLOCK_BYTES // (4 * vocab), -(-rows // MIN_BLOCKS)))


def _log_softmax(logits: torch.Tensor, rows: slice) -> torch.Tensor:
    """fp32 log-softmax of some rows as the stock loss computes it (an fp32 copy, then torch's
    kernel, which treats rows alone): row by row the stock loss's bits."""
    return torch.log_softmax(logits[rows].float(), dim=1)


class _Saved(Protocol):
    """What ``_CrossEntropySum`` uses of autograd's context: the tensors forward saves for backward."""

    saved_tensors: tuple[torch.Tensor, ...]

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


class _CrossEntropySum(torch.autograd.Function):
    """Sum over the kept rows of ``-log_softmax(row)[target]``, in fp32, for logits ``(N, V)`` in any
    floating dtype; a row whose target is ``ignore_index`` adds nothing and gets a zero gradient.

    Backward recomputes each block's log-softmax instead of saving it (memory traffic, counted in
    the profiled compute) and runs torch's own log-softmax backward on the gradient ``nll_loss``
    would give it: the stock gradient to the bit (tested on CPU). The fp32 copy of each block, rather
    than ``log_softmax(..., dtype=float32)`` on the bf16 logits, keeps the stock kernel and its
    summation order. [Note: no hand-written exp] ``exp`` and a product by hand differ from torch's
    kernel in the last bit of some fp32 elements, which the Trainer parity test's Adam steps amplify
    past its 1e-5."""

    @staticmethod
    def forward(ctx: _Saved, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        keep = target != ignore_index
        safe = torch.where(keep, target, 0)  # any valid column: the row's weight is zero
        picked = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        step = _block_rows(*logits.shape)
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            picked[rows] = _log_softmax(logits, rows).gather(1, safe[rows].unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(logits, safe, keep)
        return -torch.where(keep, picked, 0.0).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: _Saved, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, safe, keep = ctx.saved_tensors
        # nll_loss's gradient at the target; where, not a product: the mean over no kept rows
        # sends an infinite grad (1 / 0), and an ignored row's zero must be +0 as nll_loss's
        at_target = torch.where(keep, -grad.float(), 0.0).unsqueeze(1)
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
        step = _block_rows(*logits.shape)
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            log_p = _log_softmax(logits, rows)
            nll_grad = torch.zeros_like(log_p).scatter_(1, safe[rows].unsqueeze(1), at_target[rows])
            out[rows] = torch._log_softmax_backward_data(nll_grad, log_p, 1, torch.float32)
        return out, None, None


def lean_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (same signature, same value) without fp32 copies of the
    logits (module docstring). ``kwargs`` are ignored, as transformers ignores them."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    total: torch.Tensor = _CrossEntropySum.apply(logits, shift_labels, ignore_index)  # type: ignore[no-untyped-call]  # Function.apply: unannotated
    if num_items_in_batch is None:
        return total / (shift_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def use_lean_loss(model: nn.Module) -> list[str]:
    """Gives ``lean_causal_lm_loss`` to each outermost transformers model in ``model`` (the model
    itself, or the one a PEFT wrapper holds) whose ``loss_function`` resolves to transformers'
    ``ForCausalLMLoss`` (``loss_type`` ForCausalLM, ForConditionalGeneration, ...); a loss the user
    set (``model.loss_function = ...``, or a subclass's own ``loss_function``) is kept. Returns the
    classes given it. Called before the engine traces the training step, so that the planner's
    activation peak is this loss's."""
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    def outermost(module: nn.Module) -> Iterator[PreTrainedModel]:
        if isinstance(module, PreTrainedModel):
            yield module
        else:
            for child in module.children():
                yield from outermost(child)

    stock_property = PreTrainedModel.__dict__["loss_function"]
    installed = []
    for m in outermost(model):
        if type(m).loss_function is not stock_property:
            continue
        # what the property returns, without its warning for a loss_type it does not know
        loss = getattr(m, "_loss_function", None) or LOSS_MAPPING.get(
            str(getattr(m, "loss_type", None)), ForCausalLMLoss
        )
        if loss is ForCausalLMLoss:
            m.loss_function = lean_causal_lm_loss
            installed.append(type(m).__name__)
    if installed:
        logger.info(
            "%s: transformers' ForCausalLMLoss replaced by elixir_hf.loss.lean_causal_lm_loss (same value; keeps "
            "the logits in their dtype and the targets for backward, which recomputes each block's log-softmax, "
            "instead of fp32 copies of the logits); --elixir '{\"lean_loss\": false}' keeps the stock loss",
            ", ".join(installed),
        )
    return installed
