"""The model's tiles backend: cache views passed without copies, clear errors, and (GPU) the whole
model on TileLang kernels against the torch baseline at the real attention geometry."""

from __future__ import annotations

import pytest
import torch

from model import build_model, preset
from model.backend import BackendError
from tiles.backend import widen_cache_view


def test_widen_cache_view_returns_the_whole_buffer_without_a_copy():
    buf = torch.randn(3, 10, 8)  # [B, capacity, row]
    view = buf[:, :4]
    wide = widen_cache_view(view)
    assert wide.shape == (3, 10, 8) and wide.data_ptr() == buf.data_ptr()
    assert torch.equal(wide[:, :4], view)


@pytest.mark.parametrize(
    "make",
    [lambda b: b[:, 2:5], lambda b: b[:, :4, :4]],
    ids=["offset_rows", "narrow_rows"],
)
def test_widen_cache_view_copies_views_that_are_not_leading_slices(make):
    buf = torch.randn(3, 10, 8)
    view = make(buf)
    wide = widen_cache_view(view)
    assert torch.equal(wide, view) and wide.is_contiguous()


def test_widen_cache_view_of_trailing_sequences_stays_inside_the_buffer():
    buf = torch.randn(3, 10, 8)
    view = buf[1:, :4]  # sequences 1-2 of the cache
    wide = widen_cache_view(view)
    assert wide.shape == (2, 10, 8) and torch.equal(wide[:, :4], view) and torch.equal(wide, buf[1:])


def test_contiguous_tensors_pass_through():
    x = torch.randn(2, 5, 4)
    assert widen_cache_view(x) is x


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_tiles_backend_without_a_gpu_is_a_clear_error():
    with pytest.raises((BackendError, ValueError), match="CUDA GPU|GPU"):
        build_model(preset("tiny"), backend="tiles", device="cpu")


@pytest.mark.gpu
def test_flash_geometry_model_on_tiles_matches_torch():
    """flash-mini: the v4.1-flash attention/indexer/compressor shapes in a narrow model, on the TileLang kernels against
    the torch backend (the reference), two passes bitwise equal."""
    cfg = preset("flash-mini")
    model = build_model(cfg, backend="torch", device="cuda", dtype=torch.bfloat16, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
    steps = torch.randint(0, cfg.vocab_size, (3, 2), generator=torch.Generator().manual_seed(2)).cuda()

    def run():
        logits, cache = model.prefill(tokens)
        out = [logits] + [model.decode(t, cache) for t in steps]
        return torch.stack(out)  # [4, B, vocab]

    ref = run()
    from tiles.backend import TilesBackend

    model.backend = TilesBackend("cuda")
    got = run()
    assert not model.backend.fallbacks, dict(model.backend.fallbacks)
    assert torch.isfinite(got).all()
    # the kernels the backend calls (attention, indexer, compressor, FP4) give the same bits on a second pass
    assert torch.equal(run().view(torch.int16), got.view(torch.int16)), "two passes on the tiles backend differ"
    rel = ((got - ref).norm() / ref.norm()).item()
    # bf16 weights: both paths round the same activations; top-k near-ties may pick other entries.
    assert rel < 5e-2, rel


@pytest.mark.gpu
def test_flash_geometry_paged_mixed_batch_on_tiles_matches_torch():
    """flash-mini on a paged cache: three prompts of their own lengths prefilled one by one, then decode steps of all
    three at once (one joining after the first step), on the TileLang kernels (shared pools in the attention, block
    tables in the indexer, one compressor call per layer) against the torch backend on the same steps, two passes
    bitwise equal and no fallback."""
    cfg = preset("flash-mini")
    model = build_model(cfg, backend="torch", device="cuda", dtype=torch.bfloat16, seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).cuda() for n in (300, 77, 161)]
    steps = torch.randint(0, cfg.vocab_size, (3, 3), generator=gen).cuda()

    def run():
        cache = model.new_paged_cache(64, 4)
        seqs = [cache.add() for _ in prompts]
        out = [model.prefill_paged(p, cache, s) for p, s in zip(prompts, seqs, strict=True)]
        out.append(model.decode_paged(steps[0, :2], cache, seqs[:2]).flatten())  # the third joins at the next step
        out += [model.decode_paged(t, cache, seqs).flatten() for t in steps[1:]]
        return torch.cat(out)

    ref = run()
    from tiles.backend import TilesBackend

    model.backend = TilesBackend("cuda")
    got = run()
    assert not model.backend.fallbacks, dict(model.backend.fallbacks)
    assert torch.isfinite(got).all()
    assert torch.equal(run().view(torch.int16), got.view(torch.int16)), "two passes on the tiles backend differ"
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 5e-2, rel
