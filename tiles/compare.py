"""Comparison rules shared by tiles: bit-exact for quantised codes, relative L2 for floats."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tiles.contract import Comparison


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


def relative_l2(outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], tol: float) -> Comparison:
    """||out - ref|| / ||ref|| <= tol for every output, and inf/NaN exactly where the reference has them."""
    worst, detail = 0.0, []
    for key, ref in expected.items():
        out = outputs[key].float()
        ref = ref.to(out.device).float()
        if out.shape != ref.shape:
            return Comparison(False, f"rel_l2<={tol:g}", float("inf"), f"{key}: got {tuple(out.shape)}, want {tuple(ref.shape)}")
        specials = [
            (torch.isnan(out), torch.isnan(ref)),
            (torch.isposinf(out), torch.isposinf(ref)),
            (torch.isneginf(out), torch.isneginf(ref)),
        ]
        if not all(torch.equal(a, b) for a, b in specials):
            n_bad = int(sum((a != b).sum() for a, b in specials))
            return Comparison(False, f"rel_l2<={tol:g}", float("inf"), f"{key}: {n_bad} inf/NaN positions differ from the reference")
        finite = torch.isfinite(ref)
        num = (out[finite] - ref[finite]).norm().item()
        den = ref[finite].norm().item()
        err = num / den if den > 0 else num
        worst = max(worst, err)
        if err > tol:
            detail.append(f"{key}: rel_l2 {err:.3g} > {tol:g}")
    return Comparison(worst <= tol, f"rel_l2<={tol:g}", worst, "; ".join(detail))
