"""Checks on what a caller hands the model, raised as one-line errors that name the fix."""

from __future__ import annotations

import torch

from model.config import ModelConfig


class InputError(ValueError):
    """Bad token input: wrong rank, out-of-range ids, too long, mismatched cache."""


class InputTypeError(TypeError):
    """Token input of the wrong type or dtype."""


_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_tokens(tokens: object, cfg: ModelConfig, ranks: tuple[int, ...], what: str) -> torch.Tensor:
    """Validate token ids and return them as int64.

    Args:
        tokens: an integer tensor whose rank is one of ``ranks``.
        what: the calling entry point, for the message (``"prefill"``, ``"decode"``, ...).
    """
    if not isinstance(tokens, torch.Tensor):
        raise InputTypeError(f"{what}: tokens must be a torch.Tensor of int64 ids, got {type(tokens).__name__}")
    if tokens.dtype not in _INT_DTYPES:
        raise InputTypeError(f"{what}: tokens must be an integer tensor (e.g. torch.long), got {tokens.dtype}")
    if tokens.dim() not in ranks:
        shapes = " or ".join({1: "[B]", 2: "[B, N]"}[r] for r in ranks)
        raise InputError(f"{what}: tokens must have shape {shapes}, got {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        raise InputError(f"{what}: tokens is empty; pass at least one token per sequence")
    if _capturing(tokens):
        # A CUDA graph capture cannot read values back to the host; the range was checked on the
        # eager warm-up steps that every capture follows.
        return tokens.long()
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"{what}: token id {bad} is outside the vocabulary 0..{cfg.vocab_size - 1} of preset {cfg.name!r}")
    return tokens.long()


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_length(n_tokens: int, cfg: ModelConfig, what: str) -> None:
    """Reject a sequence that would grow past ``cfg.max_seq_len``."""
    if n_tokens > cfg.max_seq_len:
        raise InputError(
            f"{what}: the sequence would reach {n_tokens} tokens, more than max_seq_len={cfg.max_seq_len} of preset {cfg.name!r};"
            " shorten the prompt or raise max_seq_len with cfg.replace(max_seq_len=...)"
        )
