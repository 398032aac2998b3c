"""The CTC loss as one opaque op for the trace (speech models' CTC heads: Wav2Vec2, HuBERT,
WavLM, Data2VecAudio, SEW, ...).

``aten._ctc_loss`` returns, beside the losses, the table of forward variables
(batch, time, 2 * longest target + 1), whose size depends on the targets' values, so
torch's fake tensors cannot run it and torch.export (draft_export too) fails on every
model that trains with CTC. The table never leaves the op: its users read the losses
alone, whose shape (one per sample, or a scalar) the inputs' shapes give. So while the
model is traced, ``torch.nn.functional.ctc_loss`` (which ``nn.CTCLoss`` calls) is this
custom op, whose fake returns that shape, and whose backward is a second custom op that
calls torch's CTC backward kernel (``aten._ctc_loss_backward``) with the reduction's
gradient spelled out. Both run torch's kernels, so the values are torch's. No rule cuts them: the lowering
runs the loss whole on the gathered log-probabilities, (time, batch, classes) of the
output layer, which is small beside the model's activations.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

_REDUCTIONS = ("none", "mean", "sum")
_ctc_loss = F.ctc_loss  # torch's, whatever the trace has patched in


def _lengths(x: Any, like: torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=torch.long,
                                                              device=like.device)


@torch.library.custom_op("shardc::ctc_loss", mutates_args=())
def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor, blank: int, reduction: int,
             zero_infinity: bool) -> torch.Tensor:
    return _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=blank,
                     reduction=_REDUCTIONS[reduction], zero_infinity=zero_infinity)


@ctc_loss.register_fake
def _ctc_loss_fake(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                   target_lengths: torch.Tensor, blank: int, reduction: int,
                   zero_infinity: bool) -> torch.Tensor:
    # (time, batch, classes) or, unbatched, (time, classes): one loss per sample, or one
    return log_probs.new_empty(log_probs.shape[1:-1] if reduction == 0 else ())


@torch.library.custom_op("shardc::ctc_loss_backward", mutates_args=())
def ctc_loss_backward(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor,
                      input_lengths: torch.Tensor, target_lengths: torch.Tensor, blank: int,
                      reduction: int, zero_infinity: bool) -> torch.Tensor:
    # autograd does not record inside a custom op's body, so this is torch's CTC backward
    # called as ``F.ctc_loss``'s autograd would: the per-sample losses' gradient from the
    # reduction's (mean: each loss over its target length, clamped to 1, then the mean)
    unbatched = log_probs.dim() == 2  # (time, classes): torch runs it as a batch of one
    if unbatched:
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
        input_lengths, target_lengths = input_lengths.reshape(1), target_lengths.reshape(1)
    nll, alpha = torch.ops.aten._ctc_loss.Tensor(log_probs, targets, input_lengths,
                                                  target_lengths, blank, zero_infinity)
    if reduction == 1:
        per = grad / target_lengths.clamp(min=1).to(grad.dtype) / nll.numel()
    else:
        per = grad.reshape(-1).expand_as(nll) if unbatched else grad.expand_as(nll)
    g = torch.ops.aten._ctc_loss_backward.Tensor(
        per.contiguous(), log_probs, targets, input_lengths, target_lengths, nll, alpha, blank,
        zero_infinity)
    return g.squeeze(1) if unbatched else g


@ctc_loss_backward.register_fake
def _ctc_loss_backward_fake(grad: torch.Tensor, log_probs: torch.Tensor, *rest: Any) -> torch.Tensor:
    return torch.empty_like(log_probs)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.options = inputs[4:]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    g = ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, *ctx.options)
    return (g,) + (None,) * 6


ctc_loss.register_autograd(_backward, setup_context=_setup)


def _traceable_ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any,
                        target_lengths: Any, blank: int = 0, reduction: str = "mean",
                        zero_infinity: bool = False) -> torch.Tensor:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return torch.ops.shardc.ctc_loss(log_probs, targets, _lengths(input_lengths, log_probs),
                                     _lengths(target_lengths, log_probs), blank,
                                     _REDUCTIONS.index(reduction), zero_infinity)


@contextlib.contextmanager
def traceable_ctc_loss() -> Iterator[None]:
    """``torch.nn.functional.ctc_loss`` is the opaque op while the model is traced."""
    F.ctc_loss = _traceable_ctc_loss
    try:
        yield
    finally:
        F.ctc_loss = _ctc_loss
