"""Comparison rules shared by tiles: bit-exact for quantised codes, relative L2 for floats."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tiles.core.contract import Comparison


def bit_exact(outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> Comparison:
    """Every output tensor equal to the reference byte for byte."""
    worst, detail = 0.0, []
    for key, ref in expected.items():
        out = outputs[key]
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return Comparison(False, "bit-exact", 1.0, f"{key}: got {tuple(out.shape)} {out.dtype}, want {tuple(ref.shape)} {ref.dtype}")
        a = out.contiguous().view(torch.uint8) if out.is_floating_point() else out
        b = ref.to(out.device).contiguous().view(torch.uint8) if ref.is_floating_point() else ref.to(out.device)
        bad = (a != b).sum().item()
        if bad:
            first = tuple(int(i) for i in (a != b).nonzero()[0])
            detail.append(f"{key}: {bad} of {a.numel()} differ, first at {first}")
            worst = max(worst, bad / a.numel())
    return Comparison(worst == 0.0, "bit-exact", worst, "; ".join(detail))


CHUNK = 1 << 25  # elements compared at a time: a 64K-token attention output is 2^31 of them (8 GiB as fp32)


def relative_l2(outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], tol: float) -> Comparison:
    """||out - ref|| / ||ref|| <= tol for every output, and inf/NaN exactly where the reference has them. Compared
    :data:`CHUNK` elements at a time in fp32 (sums in fp64), so the check needs little memory beside the two tensors."""
    worst, detail = 0.0, []
    for key, ref in expected.items():
        out = outputs[key]
        if out.shape != ref.shape:
            return Comparison(False, f"rel_l2<={tol:g}", float("inf"), f"{key}: got {tuple(out.shape)}, want {tuple(ref.shape)}")
        out_flat, ref_flat = out.reshape(-1), ref.to(out.device).reshape(-1)
        num = den = 0.0
        n_bad = 0
        for lo in range(0, out_flat.numel(), CHUNK):
            a, b = out_flat[lo : lo + CHUNK].float(), ref_flat[lo : lo + CHUNK].float()
            n_bad += int(sum((f(a) != f(b)).sum() for f in (torch.isnan, torch.isposinf, torch.isneginf)))
            finite = torch.isfinite(b)
            num += float((torch.where(finite, a - b, 0.0).double() ** 2).sum())
            den += float((torch.where(finite, b, 0.0).double() ** 2).sum())
        if n_bad:
            return Comparison(False, f"rel_l2<={tol:g}", float("inf"), f"{key}: {n_bad} inf/NaN positions differ from the reference")
        num, den = num**0.5, den**0.5
        err = num / den if den > 0 else num
        worst = max(worst, err)
        if err > tol:
            detail.append(f"{key}: rel_l2 {err:.3g} > {tol:g}")
    return Comparison(worst <= tol, f"rel_l2<={tol:g}", worst, "; ".join(detail))
