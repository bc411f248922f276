"""Two-pass radix top-k (tiles/radix_select.py).

CPU: the kernels (plain, parts, merge) compile for sm_90a and sm_80, configs are checked, bad inputs give
one-line TileErrors, and the auto part count. GPU (marked): every case of ``radix_select.CASES`` against the
torch reference, exactly (same scores, so the tie rule leaves no freedom), outputs poisoned with 12345 first,
at the decode shape (64 x 128K), one long row, odd lengths and several configs (parts, threads, digit width,
capacity small enough to force the in-global fallback, the part staged in shared memory, the dedicated compaction).
"""

import re

import pytest
import torch

from tiles.core.arch import get_arch
from tiles.core.contract import TileError
from tiles.indexer import radix_select as rs

K = 512
SM90, SM80 = get_arch("sm90"), get_arch("sm80")

# ---------------------------------------------------------------------------------- CPU


def _select_call(src: str) -> tuple[list[str], list[str]]:
    """(template arguments, call arguments) of a select kernel's one ``csa2_rs::select_row`` call. The arguments:
    values, L, row, part, parts, n_valid, k, out, out_val, emit_values, pos_map, remap_block, M, then the buffers."""
    calls = re.findall(r"csa2_rs::select_row(?:_staged)?<([^>]*)>\((.*)\);", src)
    assert len(calls) == 1, calls
    return calls[0][0].split(", "), calls[0][1].split(", ")


def _signature(src: str) -> str:
    """The kernel's parameter list, from its declaration."""
    return re.search(r'extern "C" __global__ void \w+\(([^)]*)\);', src).group(1)


@pytest.mark.parametrize("arch", [SM90, SM80], ids=lambda a: a.name)
@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.slow
def test_compiles(arch, parts):
    """The default knobs at the width "auto" resolves to for the first launch's CTAs, in both launches. The first selects
    its part of the row (the part from grid y) among the valid columns and writes the candidates' values when there are
    parts; the merge reads no n_valid (every column a candidate) and maps its columns through the candidates' positions."""
    first, merge = rs._kernels(arch, K, rs.check_config({}, K), parts, rows=64)
    assert (merge is None) == (parts == 1)
    threads = rs.resolve_threads("auto", 64 * parts, arch)
    src = first.get_kernel_source()
    template, args = _select_call(src)
    assert template == [str(threads), "11", "8", "4096", "false", "true", "1"] and f"__launch_bounds__({threads}, 1)" in src
    part = ["((int)blockIdx.y)", str(parts)] if parts > 1 else ["0", "1"]
    assert args[3:7] == [*part, "n_valid[((int64_t)((int)blockIdx.x))]", str(K)]
    assert (args[9], args[11]) == (str(int(parts > 1)), "0")  # values written by the parts launch; no position map
    if merge is not None:
        src = merge.get_kernel_source()
        template, args = _select_call(src)
        assert template == [str(threads), "11", "8", "4096", "false", "true", "1"]
        assert args[3:7] == ["0", "1", "L", str(K)] and (args[9], args[11]) == ("0", "1")
        assert "n_valid" not in _signature(src) and "n_valid" in _signature(first.get_kernel_source())


def test_other_knobs_compile_sm90():
    """Each knob reaches the row's template in both launches (threads, digit bits, loads in flight, capacity,
    warp-aggregated atomics), and the shared memory is laid out for them: 2^hist_bits bins, then cap keys and cap
    positions, then the scratch words."""
    cfg = rs.check_config({"threads": 256, "hist_bits": 12, "loads": 4, "cap": 2048, "agg": True}, K)
    kernels = rs._kernels(SM90, K, cfg, 2, rows=1)
    for kernel in kernels:
        src = kernel.get_kernel_source()
        assert _select_call(src)[0] == ["256", "12", "4", "2048", "true", "true", "1"]
        offsets = dict(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src))
        assert offsets == {"hist": "0", "skey": str(4 << 12), "spos": str((4 << 12) + 4 * 2048), "scratch": str((4 << 12) + 8 * 2048)}
    assert _select_call(kernels[0].get_kernel_source())[1][4] == "2"


@pytest.mark.parametrize("arch", [SM90, SM80], ids=lambda a: a.name)
@pytest.mark.slow
def test_shared_stage_compiles_without_spills(arch, tmp_path):
    """stage="shared" (the part's scores copied into shared memory, both passes read there; wider parts run the global
    path): the parts launch and the merge build, no spills, and the staged source calls the staged row."""
    from tiles.core.ptxas import resource_usage

    cfg = rs.check_config({"stage": "shared"}, K)
    assert rs.smem_bytes(cfg) == rs.smem_bytes(rs.DEFAULT_CONFIG) + 4 * rs.STAGE_ENTRIES
    for kernel in rs._kernels(arch, K, cfg, 4, rows=64):  # 256 CTAs: "auto" gives 256 threads
        src = kernel.get_kernel_source()
        assert f"select_row_staged<256, 11, 8, 4096, false, true, 1, {rs.STAGE_ENTRIES}>" in src
        assert resource_usage(src, tmp_path, arch.nvcc_arch)[1] == 0


@pytest.mark.parametrize("arch", [SM90, SM80], ids=lambda a: a.name)
@pytest.mark.parametrize("threads", [256, 1024])
@pytest.mark.slow
def test_compact_pass_compiles_without_spills(arch, threads, tmp_path):
    """compaction="compact_pass" (one ballot per load kept across the barrier): the parts launch and the merge build,
    call the row with the flag set, and keep every register (E = 8 ballots more live across the barrier)."""
    from tiles.core.ptxas import resource_usage

    cfg = rs.check_config({"compaction": "compact_pass", "threads": threads}, K)
    for kernel in rs._kernels(arch, K, cfg, 4, rows=1):
        src = kernel.get_kernel_source()
        assert f"select_row<{threads}, 11, 8, 4096, false, true, 1>" in src
        assert resource_usage(src, tmp_path, arch.nvcc_arch)[1] == 0


@pytest.mark.slow
def test_ordered_compaction_is_still_built():
    """compaction="ordered_pass" (the general ordered pass moves the candidates; the default before session 16)."""
    src = rs._kernels(SM90, K, rs.check_config({"compaction": "ordered_pass"}, K), 1, rows=4096)[0].get_kernel_source()
    assert "select_row<256, 11, 8, 4096, false, false, 1>" in src


def test_config_checks():
    with pytest.raises(TileError, match="unknown radix_select config keys"):
        rs.check_config({"thread": 512}, K)
    with pytest.raises(TileError, match="threads=384"):
        rs.check_config({"threads": 384}, K)
    with pytest.raises(TileError, match="stage='l2'"):
        rs.check_config({"stage": "l2"}, K)
    with pytest.raises(TileError, match="compaction='fast'"):
        rs.check_config({"compaction": "fast"}, K)
    with pytest.raises(TileError, match="cap=2048 is smaller than k=4096"):
        rs.check_config({"cap": 2048}, 4096)
    assert rs.smem_bytes(rs.DEFAULT_CONFIG) <= SM80.smem_per_block


@pytest.mark.parametrize(
    "scores, n_valid, k, match",
    [
        (torch.zeros(4, 100, dtype=torch.float16), torch.zeros(4, dtype=torch.int32), K, "scores must be float32"),
        (torch.zeros(2, 4, 100), torch.zeros(2, dtype=torch.int32), K, r"scores must be float32 \[R, N\]"),
        (torch.zeros(4, 100), torch.zeros(4, dtype=torch.int64), K, r"n_valid must be int32 \[4\]"),
        (torch.zeros(4, 100), torch.zeros(3, dtype=torch.int32), K, r"n_valid must be int32 \[4\]"),
        (torch.zeros(4, 100), torch.zeros(4, dtype=torch.int32), 0, "k must be a positive int"),
        (torch.zeros(0, 100), torch.zeros(0, dtype=torch.int32), K, "must have rows and columns"),
        (torch.zeros(4, 100), torch.zeros(4, dtype=torch.int32), K, "runs on a CUDA GPU"),
    ],
)
def test_bad_inputs_raise(scores, n_valid, k, match):
    with pytest.raises(TileError, match=match):
        rs.topk_positions_fast(scores, n_valid, k, arch="sm90")


def test_auto_threads():
    """threads="auto" (the default): 512 threads while the first launch has at most one CTA per SM, else 256; both
    launches of a parts select get that width; an explicit width is kept."""
    assert rs.DEFAULT_CONFIG["threads"] == "auto"
    assert rs.resolve_threads("auto", 8, SM90) == 512  # decode B=1: 8 parts
    assert rs.resolve_threads("auto", 16 * 8, SM90) == 512
    assert rs.resolve_threads("auto", 32 * 8, SM90) == 256
    assert rs.resolve_threads("auto", 64 * 8, SM90) == 256  # decode B=64
    assert rs.resolve_threads("auto", 64, SM90) == 512  # Reindex / candidate pool at B=64: 64 rows, one part
    assert rs.resolve_threads(1024, 8, SM90) == 1024
    first, merge = rs._kernels(SM90, K, rs.check_config({}, K), 8, rows=1)
    for kernel in (first, merge):
        assert "select_row<512, 11, 8, 4096, false, true, " in kernel.get_kernel_source()
    first, merge = rs._kernels(SM90, K, rs.check_config({}, K), 8, rows=64)
    assert "select_row<256, 11, 8, 4096, false, true, " in merge.get_kernel_source()
    src = rs.remapped_kernel(SM90, K, 64, block=8).get_kernel_source()
    assert "select_row<512, 11, 8, 4096, false, true, 8>" in src
    # the bounds that hold before the shape is known take the widest auto width
    assert rs.smem_bytes({"threads": "auto"}) == rs.smem_bytes({"threads": 512})


def test_auto_parts():
    assert rs.resolve_parts("auto", 4096, 8192, K, SM90) == 1  # rows alone fill the GPU
    assert rs.resolve_parts("auto", 1, 131072, K, SM90) == 8  # slices stay >= MIN_PART * k wide
    assert rs.resolve_parts("auto", 1, 1000, K, SM90) == 1
    assert rs.resolve_parts(8, 4096, 8192, K, SM90) == 8  # an explicit setting is kept
    assert rs.resolve_parts("auto", 64, 131072, K, SM90) == 8  # decode B=64: 512 CTAs
    assert rs.resolve_parts("auto", 1024, 131072, K, SM90) == 1


def test_reference_follows_the_tie_rule():
    scores = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 2.0, 3.0, 5.0]])
    got = rs.reference_topk(scores, torch.tensor([6], dtype=torch.int32), 3)  # column 6 is not valid
    assert got.tolist() == [[1, 2, 5]]
    got = rs.reference_topk(scores, torch.tensor([2], dtype=torch.int32), 3)
    assert got.tolist() == [[0, 1, -1]]


# ---------------------------------------------------------------------------------- GPU


def _run(R: int, N: int, case: str, config: dict, seed: int) -> None:
    scores, n_valid = rs.make_case(case, R, N, K, seed, "cuda")
    out = torch.full((R, K), 12345, dtype=torch.int32, device="cuda")  # [R, K] poisoned
    rs.select_launcher(R, N, K, "cuda", config=config)(scores, n_valid, out)
    want = rs.reference_topk(scores, n_valid, K)
    bad = (out != want).any(1)
    assert not bool(bad.any()), f"{case} R={R} N={N} {config}: rows {bad.nonzero().flatten()[:8].tolist()} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("case", rs.CASES)
@pytest.mark.parametrize("R, N", [(64, 131072), (1, 131072), (3, 1000), (5, 77), (1, 8191)])
def test_matches_reference(case, R, N):
    _run(R, N, case, {}, seed=R + N)


CONFIGS = {
    "parts1": {"parts": 1},
    "parts8": {"parts": 8},
    "t256_hb12": {"threads": 256, "hist_bits": 12},
    "t1024_agg": {"threads": 1024, "agg": True, "loads": 16},
    "t512_loads32_cap8k": {"threads": 512, "loads": 32, "cap": 8192},
    "small_cap": {"cap": K},  # most rows overflow the shared candidates: the in-global passes decide
    "staged": {"stage": "shared"},
    "staged_parts8_t512": {"stage": "shared", "parts": 8, "threads": 512},
    "staged_small_cap": {"stage": "shared", "cap": K},
    "ordered_compaction": {"compaction": "ordered_pass"},
    "compact_t1024_loads16": {"threads": 1024, "loads": 16},
    "ordered_parts8_small_cap": {"compaction": "ordered_pass", "parts": 8, "cap": K},
    "ordered_staged": {"compaction": "ordered_pass", "stage": "shared"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
def test_configs_match_reference(config):
    for case in rs.CASES:
        for R, N in [(64, 32768), (3, 1000), (2, 77)]:
            _run(R, N, case, CONFIGS[config], seed=7 * R + N)


@pytest.mark.gpu
def test_shared_stage_falls_back_for_wide_parts():
    """A part wider than the stage (70001 in 4 parts of 17501 > STAGE_ENTRIES) runs the global path in the same kernel;
    rows of 16383 (one part, just under the stage) and of 77 are staged by the 4-byte copy (their rows are not 16-byte
    aligned)."""
    for R, N, parts in [(7, 70001, 4), (3, 16383, 1), (5, 77, 1)]:
        for case in rs.CASES:
            _run(R, N, case, {"stage": "shared", "parts": parts}, seed=R + N)


_TORCH_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    """torch.empty whose memory is poisoned (as ``_run``'s 12345): int32 buffers hold the most negative value (neither a
    position nor the -1 fill), floats NaN."""
    t = _TORCH_EMPTY(*args, **kwargs)
    if t.dtype == torch.int32:
        t.fill_(torch.iinfo(torch.int32).min)
    elif t.dtype == torch.float32:
        t.fill_(float("nan"))
    return t


def _call_twice(call) -> torch.Tensor:
    """``call()`` of the public wrapper (it allocates its output) twice, every torch.empty inside poisoned: the first
    result, after requiring the second to be equal. A slot never written stays poisoned, which the exact reference
    comparison refuses."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", _poisoned_empty)
        first, second = call(), call()
    assert torch.equal(first, second), "two calls differ"
    return first


@pytest.mark.gpu
def test_wrapper_and_noncontiguous_scores():
    scores, n_valid = rs.make_case("ties10", 6, 4000, K, 3, "cuda")
    wide = torch.stack([scores, scores], dim=2)[..., 0]  # [6, 4000], strided: copied by the wrapper
    assert torch.equal(_call_twice(lambda: rs.topk_positions_fast(wide, n_valid, K)), rs.reference_topk(scores, n_valid, K))
    assert torch.equal(_call_twice(lambda: rs.topk_positions_fast(scores, n_valid, 7)), rs.reference_topk(scores, n_valid, 7))
