"""Indexer tiles: indexer_topk, candidate_pool, reindex_topk.

CPU: the default configs compile for sm_90a, constraints prune bad configs, bad inputs give
one-line TileErrors, and the top-k set comparison rule itself. GPU (marked): every tile
against the torch reference on fresh random data (real and odd shapes, n_visible < top-k,
empty rows, heavy ties), outputs poisoned first, two runs bitwise equal (tiles.core.harness).
"""

import ast
import inspect
import re

import pytest
import torch
from cuda_source import cuda_function as _cuda_function
from cuda_source import source_text as _source_text

from model.ops.indexer import candidate_blocks, topk_positions
from tiles import indexer as ix
from tiles.core.arch import get_arch
from tiles.core.contract import Shape, TileError
from tiles.core.harness import OK, evaluate
from tiles.core.ptxas import parse_resource_usage, ptxas_log, resource_usage
from tiles.indexer import dequant as ix_dequant
from tiles.indexer import launch as ix_launch
from tiles.indexer import reference as ix_reference
from tiles.indexer import score_kernel as ix_score_kernel
from tiles.indexer import space as ix_space

SM90 = get_arch("sm90")
DECODE_GRID = (64, 131072)  # score rows and length of decode B=64 x 128K: tiles_per_cta="auto" resolves to 16 there
# The Hopper default's tile layout before session 7 (128-entry tiles on two consumer warpgroups, two stages): the tests
# of occupancy, register split and fragment rows below were written for it and pin it.
TWO_WARPGROUPS = {"block_n": 128, "threads": 256, "stages": 2}
IDX = {"Hi": 32, "Di": 128, "K": 512}


def _odd(B: int, S: int, N: int) -> Shape:
    return Shape(f"odd_b{B}_s{S}_n{N}", "decode", {"B": B, "S": S, "N": N, "P": 2048, "block": 8, **IDX})


# ---------------------------------------------------------------------------------- CPU

# What each dequant leaves in the score kernel (the kernel itself, not the helpers it imports): the wgmma's A operand
# (registers, or a bf16 tile in shared memory) and how the codes become bf16: through the scale's exponent bits as a
# float (<< 23), as the integer bf16 patterns of the bits paths, through the byte LUT, or by the path's own helper.
DEQUANT_MARKS = {
    "rs": "wgmma_rs",
    "ss": "wgmma_ss",
    "float_scale": "<< (uint)23",
    "int_bits": "- 1) << 7)",
    "lut": "void* lut",
    "prmt": "csa2_fp4_group_bf16(",
    "prmt_rs": "csa2_fp4_pair_bf16(",
    "fma_rs": "csa2_fp4_pair_fma(",
}
DEQUANT_SOURCES = {
    "shared": {"ss", "float_scale"},
    "registers": {"rs", "float_scale"},
    "lut": {"ss", "float_scale", "lut"},
    "bits": {"ss", "int_bits"},
    "fragment_bits": {"rs", "int_bits"},
    "prmt": {"ss", "prmt"},
    "prmt_rs": {"rs", "prmt_rs"},
    "fma_rs": {"rs", "fma_rs"},
}


def _kernel_part(src: str) -> str:
    """A generated source from the kernel's declaration on: the helpers it imports left out."""
    return src[src.index('extern "C"') :]


def _dequant_marks(src: str) -> set[str]:
    """The DEQUANT_MARKS a score kernel's source shows."""
    kernel = _kernel_part(src)
    return {mark for mark, text in DEQUANT_MARKS.items() if text in kernel}


@pytest.mark.parametrize("tile", ix.TILES, ids=lambda t: t.name)
def test_default_compiles_sm90(tile):
    """The kernels one call launches, as the default configures them: the score kernel's dequant (DEQUANT_SOURCES) and
    signature (Reindex's gathered variant reads the pool's block ids and K by pointer, the contiguous one K through a
    TMA descriptor); the select's row maps its columns through the pool's blocks in Reindex only."""
    shape, cfg = tile.shapes()[0], tile.default_config(SM90)
    assert tile.search_space(SM90).violations(cfg, shape, SM90) == []
    sources = tile.kernel_sources(shape, cfg, SM90)
    assert set(sources) == ({"block_max", "select"} if tile is ix.CANDIDATE_POOL else {"score", "select"})
    if "score" in sources:
        assert _dequant_marks(sources["score"]) == DEQUANT_SOURCES[cfg["dequant"]]
        signature = _kernel_part(sources["score"]).split(";")[0]
        gather = tile is ix.REINDEX_TOPK
        assert ("const int* __restrict__ pool" in signature, "CUtensorMap k_words_desc" in signature) == (gather, not gather)
    remap = shape["block"] if tile is ix.REINDEX_TOPK else 1
    assert f"11, 8, 4096, false, true, {remap}>(" in _kernel_part(sources["select"])


@pytest.mark.parametrize("tile", [ix.INDEXER_TOPK, ix.REINDEX_TOPK], ids=lambda t: t.name)
@pytest.mark.parametrize("dequant", ["shared", "registers", "lut", "bits", "fragment_bits", "prmt", "prmt_rs", "fma_rs"])
@pytest.mark.slow
def test_dequant_options_compile_sm90(tile, dequant):
    """Each dequant builds the score kernel it names and no other's: its A operand and its decode (DEQUANT_SOURCES, one
    set of marks per dequant)."""
    assert len({frozenset(marks) for marks in DEQUANT_SOURCES.values()}) == len(DEQUANT_SOURCES)
    shape = tile.shapes()[0]
    sources = tile.kernel_sources(shape, tile.with_defaults(SM90, {"dequant": dequant}), SM90)
    assert _dequant_marks(sources["score"]) == DEQUANT_SOURCES[dequant]


# The dequant emulations below mirror the CUDA helpers (and the TileLang formula) the score kernels ship, statement by
# statement; each is followed by a test that looks its statements up in the shipped source, so that a changed constant,
# selector or shift there fails on the CPU (the attention's test_prmt_emulation_follows_the_cuda_source does the same).


def _assert_follows(src: str, helper: str, statements: tuple[str, ...]) -> None:
    """Every one of ``statements`` is in the CUDA helper ``helper`` of ``src``."""
    body = _cuda_function(src, helper)
    for stmt in statements:
        assert stmt in body, f"{helper}: {stmt}"


def _bits_dequant(codes: torch.Tensor, sbyte: torch.Tensor) -> torch.Tensor:
    """Torch mirror of the "bits" dequant's integer formula (tiles.indexer.dequant.dequant_words_bits; _BITS_STATEMENTS)."""
    mag, base = codes & 7, (sbyte - 1) << 7
    bits = torch.where(mag == 0, 0, base + torch.where(mag == 1, 0, mag << 6)) | ((codes & 8) << 12)
    return (bits.to(torch.int32) << 16).view(torch.float32)  # bf16 bits as the top half of an fp32


# dequant_words_bits (a T.macro: TileLang) in the statements _bits_dequant mirrors; code e of a word is nibble e
_BITS_STATEMENTS = (
    "base = (((ks_s[i] >> ((c // (GROUP // 8)) * 8)) & 0xFF) - 1) << 7",
    "code = (word >> (e * 4)) & 0xF",
    "mag = code & 7",
    "bits = T.if_then_else(mag == 0, 0, base + T.if_then_else(mag == 1, 0, mag << 6)) | ((code & 8) << 12)",
    'vals[e] = T.reinterpret(T.Cast("uint16", bits), "bfloat16")',
)


def _python_function(module, name: str) -> str:
    """The module-level function (or T.macro) ``name`` of ``module``, from its def on (see :func:`_source_text`)."""
    src = inspect.getsource(module)
    fn = next(f for f in ast.parse(src).body if isinstance(f, ast.FunctionDef) and f.name == name)
    return _source_text(ast.get_source_segment(src, fn), "#")


def test_bits_dequant_emulation_follows_the_tilelang_source():
    src = _python_function(ix_dequant, "dequant_words_bits")
    for stmt in _BITS_STATEMENTS:
        assert stmt in src, stmt


def test_fragment_bits_holds_no_bf16_tile_in_shared_memory():
    """dequant=fragment_bits builds the same bf16 patterns into the wgmma A fragment: the shared-memory budget counts
    no per-stage bf16 tile, so four stages of 256-entry tiles fit where the bits path's do not."""
    # one warpgroup: block_n 256 on two is pruned by the fragment_rows constraint (see the test below)
    cfg = ix.INDEXER_TOPK.with_defaults(SM90, {"block_n": 256, "threads": 128, "stages": 4, "tiles_per_cta": 4, "epilogue": "per_tile"})
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    assert ix.INDEXER_TOPK.search_space(SM90).violations({**cfg, "dequant": "fragment_bits"}, shape, SM90) == []
    assert any("shared memory" in r for r in ix.INDEXER_TOPK.search_space(SM90).violations({**cfg, "dequant": "bits"}, shape, SM90))


def _prmt(x: int, y: int, sel: int) -> int:
    """PTX prmt.b32 (default mode) / __byte_perm on Python ints; selector bit 3 (sign replicate) must be clear."""
    src = (x & 0xFFFFFFFF) | ((y & 0xFFFFFFFF) << 32)
    out = 0
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        assert nib < 8, "selector nibble with the sign-replicate bit"
        out |= ((src >> (8 * nib)) & 0xFF) << (8 * n)
    return out


def test_prmt_emulation_is_the_default_mode_prmt():
    """csa2_prmt (tiles.fp4.kernel.PRMT_ASM_CUDA, which the indexer's prmt helpers call) is prmt.b32 in the default mode
    on (b:a) by sel, as _prmt models it."""
    _assert_follows(ix_dequant.PRMT_ASM_CUDA, "csa2_prmt", ('asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));',))


def _prmt_group(words: list[int], sbyte: int) -> list[int]:
    """Line-by-line model of tiles.indexer.dequant.PRMT_CUDA (csa2_fp4_group_bf16): 4 words -> 16 bf16x2 words."""
    m32 = 0xFFFFFFFF
    base = ((sbyte - 1) << 7) & m32
    b2 = (base * 0x10001) & m32
    r0, r1, r2, r3 = (base << 16) & m32, (b2 + 0x00C00080) & m32, (b2 + 0x01400100) & m32, (b2 + 0x01C00180) & m32
    lo0, lo1, hi0, hi1 = _prmt(r0, r1, 0x6420), _prmt(r2, r3, 0x6420), _prmt(r0, r1, 0x7531), _prmt(r2, r3, 0x7531)
    out = []
    for w in words:
        m = w & 0x77777777
        mh, w4 = m >> 16, (w << 4) & m32
        l0, l1 = _prmt(lo0, lo1, m & 0xFFFF), _prmt(lo0, lo1, mh)
        h0 = _prmt(hi0, hi1, m & 0xFFFF) | (_prmt(w, w4, 0x1504) & 0x80808080)
        h1 = _prmt(hi0, hi1, mh) | (_prmt(w, w4, 0x3726) & 0x80808080)
        out += [_prmt(l0, h0, 0x5140), _prmt(l0, h0, 0x7362), _prmt(l1, h1, 0x5140), _prmt(l1, h1, 0x7362)]
    return out


_PRMT_GROUP_STATEMENTS = (  # csa2_fp4_group_bf16, in _prmt_group's order
    "const unsigned base = (sbyte - 1u) << 7;",
    "const unsigned b2 = base * 0x10001u;",
    "const unsigned r0 = base << 16;",
    "const unsigned r1 = b2 + 0x00C00080u;",
    "const unsigned r2 = b2 + 0x01400100u;",
    "const unsigned r3 = b2 + 0x01C00180u;",
    "const unsigned lo0 = __byte_perm(r0, r1, 0x6420), lo1 = __byte_perm(r2, r3, 0x6420);",
    "const unsigned hi0 = __byte_perm(r0, r1, 0x7531), hi1 = __byte_perm(r2, r3, 0x7531);",
    "for (int k = 0; k < 4; ++k) { const unsigned w = src[k];",
    "const unsigned m = w & 0x77777777u;",
    "const unsigned mh = m >> 16;",
    "const unsigned w4 = w << 4;",
    "const unsigned l0 = __byte_perm(lo0, lo1, m), l1 = __byte_perm(lo0, lo1, mh);",
    "const unsigned h0 = __byte_perm(hi0, hi1, m) | (__byte_perm(w, w4, 0x1504) & 0x80808080u);",
    "const unsigned h1 = __byte_perm(hi0, hi1, mh) | (__byte_perm(w, w4, 0x3726) & 0x80808080u);",
    "dst[4 * k + 0] = __byte_perm(l0, h0, 0x5140);",
    "dst[4 * k + 1] = __byte_perm(l0, h0, 0x7362);",
    "dst[4 * k + 2] = __byte_perm(l1, h1, 0x5140);",
    "dst[4 * k + 3] = __byte_perm(l1, h1, 0x7362);",
)


def test_prmt_group_emulation_follows_the_cuda_source():
    _assert_follows(ix_dequant.PRMT_CUDA, "csa2_fp4_group_bf16", _PRMT_GROUP_STATEMENTS)


def test_prmt_dequant_equals_the_bits_formula():
    """dequant=prmt's byte-permute tables give the bits path's patterns for every code pair at every scale byte 1..252
    (so its scores equal the bits kernel's bitwise), and all-zero words at scale byte 0 (the out-of-range fill) give 0."""
    import random

    rng = random.Random(0)
    for sbyte in range(1, 253):
        words = [rng.getrandbits(32) for _ in range(4)]
        if sbyte % 16 == 1:  # every code at every position at least once
            words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567]
        got = _prmt_group(words, sbyte)
        codes = torch.tensor([(w >> (4 * j)) & 0xF for w in words for j in range(8)], dtype=torch.int32)
        want = (_bits_dequant(codes, torch.full_like(codes, sbyte)).view(torch.int32) >> 16) & 0xFFFF
        got_vals = [(g >> (16 * h)) & 0xFFFF for g in got for h in range(2)]
        if sbyte == 1:  # the bits formula's own convention there: code 1 -> +-0 (only all-zero groups use byte 1)
            want = torch.where((codes & 7) == 1, (codes & 8) << 12, want)
        assert got_vals == want.tolist(), sbyte
    assert _prmt_group([0, 0, 0, 0], 0) == [0] * 16


def _rs_tables(sbyte: int) -> list[int]:
    """Model of csa2_fp4_table_word (tiles.indexer.dequant.PRMT_PAIR_CUDA): lo0, lo1, hi0, hi1 of a scale byte 0..255."""
    m32 = 0xFFFFFFFF
    base = ((sbyte - 1) << 7) & m32
    b2 = (base * 0x10001) & m32
    r0, r1, r2, r3 = (base << 16) & m32, (b2 + 0x00C00080) & m32, (b2 + 0x01400100) & m32, (b2 + 0x01C00180) & m32
    return [_prmt(r0, r1, 0x6420), _prmt(r2, r3, 0x6420), _prmt(r0, r1, 0x7531), _prmt(r2, r3, 0x7531)]


_RS_TABLES_STATEMENTS = (  # csa2_fp4_table_word: table word e of _rs_tables
    "const unsigned base = ((unsigned)sbyte - 1u) << 7;",
    "const unsigned b2 = base * 0x10001u;",
    "const unsigned r0 = base << 16, r1 = b2 + 0x00C00080u, r2 = b2 + 0x01400100u, r3 = b2 + 0x01C00180u;",
    "const unsigned sel = (e & 2) ? 0x7531 : 0x6420;",
    "return (e & 1) ? __byte_perm(r2, r3, sel) : __byte_perm(r0, r1, sel);",
)


def _rs_pair(w: int, tables: list[int], k: int) -> int:
    """Model of csa2_fp4_pair_bf16: bf16x2 of nibbles 2k (low half), 2k + 1 of w from the scale byte's tables."""
    lo0, lo1, hi0, hi1 = tables
    m, w4 = w & 0x77777777, (w << 4) & 0xFFFFFFFF
    sel, sign = (m & 0xFFFF, _prmt(w, w4, 0x1504)) if k < 2 else (m >> 16, _prmt(w, w4, 0x3726))  # prmt reads 16 bits
    lo, hi = _prmt(lo0, lo1, sel), _prmt(hi0, hi1, sel) | (sign & 0x80808080)
    return _prmt(lo, hi, 0x7362 if k & 1 else 0x5140)


_RS_PAIR_STATEMENTS = (  # csa2_fp4_pair_bf16 (and its prmt_rs2 twin but for mh), in _rs_pair's order
    "const unsigned w = (unsigned)w_;",
    "const unsigned m = w & 0x77777777u;",
    "const unsigned w4 = w << 4;",
    "if (k < 2) { l = csa2_prmt(lo0, lo1, m); h = csa2_prmt(hi0, hi1, m) | (__byte_perm(w, w4, 0x1504) & 0x80808080u); } else {",
    "l = csa2_prmt(lo0, lo1, mh); h = csa2_prmt(hi0, hi1, mh) | (__byte_perm(w, w4, 0x3726) & 0x80808080u); }",
    "*(unsigned*)dst = __byte_perm(l, h, (k & 1) ? 0x7362 : 0x5140);",
)


def test_prmt_rs_emulation_follows_the_cuda_source():
    """_rs_tables and _rs_pair are PRMT_PAIR_CUDA's csa2_fp4_table_word and csa2_fp4_pair_bf16 (the high-half selectors
    m >> 16 by shr.b32), statement by statement."""
    _assert_follows(ix_dequant.PRMT_PAIR_CUDA, "csa2_fp4_table_word", _RS_TABLES_STATEMENTS)
    shr = 'unsigned mh; asm("shr.b32 %0, %1, 16;" : "=r"(mh) : "r"(m));'
    _assert_follows(ix_dequant.PRMT_PAIR_CUDA, "csa2_fp4_pair_bf16", (*_RS_PAIR_STATEMENTS, f"}} else {{ {shr} l = csa2_prmt"))


def test_rs_pair_equals_the_prmt_group_path():
    """prmt_rs's per-register pairs from the shared scale table are the prmt path's bf16 words, for every scale byte."""
    import random

    rng = random.Random(2)
    for sbyte in range(256):
        words = [rng.getrandbits(32) for _ in range(4)]
        tables = _rs_tables(sbyte)
        assert [_rs_pair(w, tables, k) for w in words for k in range(4)] == _prmt_group(words, sbyte), sbyte


def _wgmma_a_owner(row: int, col: int) -> tuple[int, int]:
    """(thread of the warpgroup, 16-bit register slot) holding A[row, col] of a 64 x 16k bf16 wgmma RS operand.

    PTX ISA, wgmma .m64nNk16 A register fragment: lane l of warp w holds rows 16w + l / 4 (+ 8) and, per k16 slice,
    columns 2 (l % 4) + {0, 1} (+ 8); slots a0..a7 = (row, col), (row, col + 1), (row + 8, ..), .., (row + 8, col + 9),
    a register = slots (2r, 2r + 1). TileLang's local array is these slots slice after slice (k_deq + 8 ki).
    """
    warp, g = row // 16, row % 8
    lane = 4 * g + (col % 8) // 2
    slot = 8 * (col // 16) + 4 * ((col % 16) // 8) + 2 * ((row % 16) // 8) + col % 2
    return 32 * warp + lane, slot


def test_rs_dim_order_gives_each_thread_one_scale_group():
    """prmt_rs: in the wgmma A layout each thread's 32 columns of a row are one scale group under _rs_dim (4 packed
    words, one scale byte), its registers pair two consecutive columns (the pair the kernel writes as one word), and
    _rs_dim is a permutation of the 128 dims (so with q in the same order every product appears once)."""
    assert sorted(ix_dequant._rs_dim(c) for c in range(128)) == list(range(128))
    for t in range(128):
        for row in range(64):
            cols = [c for c in range(128) if _wgmma_a_owner(row, c)[0] == t]
            if not cols:
                continue
            assert len(cols) == 32
            dims = sorted(ix_dequant._rs_dim(c) for c in cols)
            assert dims == list(range(dims[0], dims[0] + 32)) and dims[0] % 32 == 0  # one scale group
    for row in range(64):
        for c in range(0, 128, 2):  # the pair (c, c + 1) is one register: slots 2r, 2r + 1 of one thread
            (t0, s0), (t1, s1) = _wgmma_a_owner(row, c), _wgmma_a_owner(row, c + 1)
            assert t0 == t1 and s0 % 2 == 0 and s1 == s0 + 1
            assert ix_dequant._rs_dim(c + 1) == ix_dequant._rs_dim(c) + 1


def test_prmt_rs_fragment_emulation_equals_the_reference_dot_products():
    """CPU emulation of one 64-row tile of the prmt_rs kernel: every thread fills its A registers by the kernel's rule
    (element (i, c), c even: byte (c // 8) % 4 of word 4t + c // 32, t = (c % 8) // 2, scale byte t, one 32-bit
    pair), the registers are read back through the wgmma layout, and A @ q_s^T with q_s[h, c] = q[h, _rs_dim(c)]
    equals the scores' K @ q^T exactly (products and sums in float64 of exact values)."""
    import random

    rng = random.Random(1)
    rows = 64
    words = [[rng.getrandbits(32) for _ in range(16)] for _ in range(rows)]  # [64, 16] packed K
    sbytes = [[rng.randint(100, 140) for _ in range(4)] for _ in range(rows)]  # [64, 4] E8M0
    regs = {}  # (thread, slot) -> bf16 bits, written the way the kernel's loop writes them
    for i in range(rows):
        for c in range(0, 128, 2):
            t, j = (c % 8) // 2, c // 8
            pair = _rs_pair(words[i][4 * t + j // 4], _rs_tables(sbytes[i][t]), j % 4)
            thread, slot = _wgmma_a_owner(i, c)
            regs[(thread, slot)], regs[(thread, slot + 1)] = pair & 0xFFFF, pair >> 16
    frag = torch.tensor([[regs[_wgmma_a_owner(i, c)] for c in range(128)] for i in range(rows)], dtype=torch.int32)
    a = (frag << 16).view(torch.float32).double()  # [64, 128] what wgmma multiplies, in fragment column order
    codes = torch.tensor([[(w >> (4 * n)) & 0xF for w in ws for n in range(8)] for ws in words], dtype=torch.int32)
    scale = torch.tensor(sbytes, dtype=torch.int32).repeat_interleave(32, dim=1)  # [64, 128]
    k = _bits_dequant(codes, scale).double()  # [64, 128] K in dim order
    perm = torch.tensor([ix_dequant._rs_dim(c) for c in range(128)])
    assert torch.equal(a, k[:, perm])
    q = torch.randint(-6, 7, (32, 128)).double() * 0.5  # [32, 128] FP4-like queries
    assert torch.equal(a @ q[:, perm].T, k @ q.T)


def _call_args(src: str, name: str) -> list[str]:
    """The argument expressions of the last call of ``name`` in the CUDA source (split at top-level commas); the
    imported helper definitions come first."""
    i = src.rindex(name + "(") + len(name) + 1
    args, depth, cur = [], 0, ""
    for ch in src[i:]:
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        if ch == ")" and depth == 0:
            return args + [cur.strip()]
        depth += (ch in "([") - (ch in ")]")
        cur += ch
    raise AssertionError(f"unterminated call of {name}")


def _per_thread_reads(src: str, var: str, exprs: tuple, threads: int, producer: int) -> dict:
    """Evaluate a generated dequant call's index expressions (packed word, scale row, scale shift, k) for every consumer
    thread and even fragment slot ``var`` of its loop (pipeline stage 0):
    {(thread, slot): (row of the packed word, word, row of the scale, scale byte, k)}."""

    extent = int(re.search(rf"for \(int {var} = 0; {var} < (\d+); \+\+{var}\)", src).group(1))
    exprs = [e.replace("((int)threadIdx.x)", "tx") for e in exprs]
    out = {}
    for t in range(threads):
        for v in range(0, extent, 2):
            env = {"tx": t + producer, var: v, "t_1": 0}
            w, r, sh, k = (eval(e, {}, env) for e in exprs)
            out[(t, v)] = (w // 16, w % 16, r, sh // 8, k)
    return out


def _assert_every_pair_once_one_group_per_thread(reads: dict, block_n: int) -> None:
    """``reads`` (from :func:`_per_thread_reads`): every (row, packed word, k) of a ``block_n``-row tile is converted
    exactly once, with the scale byte of its own row and group, and each thread reads one scale group per row."""
    seen, groups = {}, {}
    for (t, _), (row, word, srow, group, k) in reads.items():
        assert srow == row and group == word // 4
        seen[(row, word, k)] = seen.get((row, word, k), 0) + 1
        groups.setdefault((t, row), set()).add(word // 4)
    assert set(seen.values()) == {1} and len(seen) == block_n * 16 * 4
    assert all(len(g) == 1 for g in groups.values())


def _rs_source_reads(src: str, threads: int, producer: int) -> dict:
    """The generated prmt_rs dequant call, evaluated per consumer thread and A slot (pipeline stage 0):
    {(thread, slot): (row of the packed word, word, row of the scale, scale byte, k)} for the even slots it writes."""

    dst, word, tab0, *tabs, k_e = _call_args(src, "csa2_fp4_pair_bf16")
    var = re.fullmatch(r"\(&\(k_deq\[(\w+)\]\)\)", dst).group(1)
    word_e = re.fullmatch(r"\(\(int\*\)kw_s\)\[(.*)\]", word).group(1)
    row_e, shift_e = re.fullmatch(r"\(\(uint\*\)rs_tab\)\[\(\(\(\(\(int\*\)ks_s\)\[(.*)\] >> (.*)\) & 255\) \* 4\)\]", tab0).groups()
    for e, tab in enumerate(tabs, 1):  # the group's other table words: entries + 1, + 2, + 3 of the same scale byte
        assert tab == f"((uint*)rs_tab)[({tab0[len('((uint*)rs_tab)[') : -1]} + {e})]", tab
    return _per_thread_reads(src, var, (word_e, row_e, shift_e, k_e), threads, producer)


@pytest.mark.parametrize(
    "cfg,gather",
    [
        ({"dequant": "prmt_rs", "min_ctas": 2}, False),  # 2 warpgroups x 1 m-tile
        ({"dequant": "prmt_rs", "threads": 128, "block_n": 64, "min_ctas": 4, "stages": 4}, False),
        ({"dequant": "prmt_rs", "threads": 128, "block_n": 128, "min_ctas": 3, "stages": 4}, False),  # 2 m-tiles
        ({"dequant": "prmt_rs", "min_ctas": 2}, True),  # Reindex: not warp-specialised
        ({"dequant": "prmt_rs", "min_ctas": 2, "epilogue": "hoisted"}, False),  # the dequant is untouched by the epilogue
    ],
    ids=["t256_bn128", "t128_bn64", "t128_bn128", "gather_t256", "t256_bn128_hoisted"],
)
@pytest.mark.slow
def test_prmt_rs_generated_dequant_covers_every_pair_once_one_group_per_thread(cfg, gather):
    """The CUDA TileLang generates for the prmt_rs dequant, evaluated for every consumer thread: every (row, word,
    byte) of the tile is converted exactly once, the scale byte is the word's own group's of the same row, and each
    thread reads one scale group (4 words) per row: one 16-byte shared load and one table per row and thread."""
    tile = ix.REINDEX_TOPK if gather else ix.INDEXER_TOPK
    full = {**tile.default_config(SM90), **cfg}
    src = ix_launch.build_score(SM90, full, gather, 8, *DECODE_GRID).get_kernel_source()
    reads = _rs_source_reads(src, full["threads"], 0 if gather else full["threads"])
    _assert_every_pair_once_one_group_per_thread(reads, full["block_n"])


def test_prmt_rs_compiles_with_register_split():
    """prmt_rs on two consumer warpgroups of 128-entry tiles at 2 CTAs per SM (2 x 512 threads, 64 registers at launch):
    RS wgmma, no bf16 tile in shared memory, setmaxnreg 24 (producer) / 104 (consumers) so ptxas neither spills nor
    serialises the wgmmas."""
    cfg = {**ix.INDEXER_TOPK.default_config(SM90), **TWO_WARPGROUPS, "epilogue": "hoisted", "dequant": "prmt_rs"}
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    assert ix.INDEXER_TOPK.search_space(SM90).violations(cfg, shape, SM90) == []
    src = ix_launch.build_score(SM90, cfg, False, 8, *DECODE_GRID).get_kernel_source()
    assert "wgmma_rs" in src and "wgmma_ss" not in src and "csa2_fp4_pair_bf16" in src and "csa2_fp4_table_word" in src
    assert "void* k_deq" not in src and "bfloat16_t k_deq[64];" in src  # a register array, not a shared tile
    assert "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<104>" in src
    assert ix_dequant.rs_register_split(256, 2) == (24, 104) and ix_dequant.rs_register_split(128, 3) == (24, 136)
    cfg0 = {**cfg, "min_ctas": 0}  # no launch-bound cap: ptxas's own allocation, no setmaxnreg
    assert "warpgroup_reg_alloc" not in ix_launch.build_score(SM90, cfg0, False, 8, *DECODE_GRID).get_kernel_source()


def test_hopper_default_is_one_consumer_warpgroup_of_256_entry_tiles():
    """The Hopper default (2 x 256 threads per SM): each consumer thread holds 4 m-tiles of A fragment (256 bf16), the
    producer gives its registers to the one consumer warpgroup (24 / 232), and the RS wgmma reads no shared bf16 tile."""
    cfg = ix.INDEXER_TOPK.default_config(SM90)
    assert (cfg["block_n"], cfg["threads"], cfg["stages"], cfg["dequant"]) == (256, 128, 1, "prmt_rs")
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    assert ix.INDEXER_TOPK.search_space(SM90).violations(cfg, shape, SM90) == []
    src = ix_launch.build_score(SM90, cfg, False, 8, *DECODE_GRID).get_kernel_source()
    assert "wgmma_rs" in src and "wgmma_ss" not in src and "void* k_deq" not in src and "bfloat16_t k_deq[256];" in src
    assert "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<232>" in src


def test_prmt_rs_register_constraint():
    """Two m-tiles per warpgroup (128 threads, block_n 128) need ~128 consumer registers: min_ctas 4 leaves 104 (ptxas:
    spills + serialised wgmmas), pruned; min_ctas 3 leaves 136, kept. Two warpgroups need one m-tile each."""
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    space = ix.INDEXER_TOPK.search_space(SM90)
    cfg = {**ix.INDEXER_TOPK.default_config(SM90), "dequant": "prmt_rs", "threads": 128, "block_n": 128, "stages": 4}
    assert any("prmt_rs" in r for r in space.violations({**cfg, "min_ctas": 4}, shape, SM90))
    assert space.violations({**cfg, "min_ctas": 3}, shape, SM90) == []
    assert space.violations({**cfg, "block_n": 64, "min_ctas": 4}, shape, SM90) == []
    wide = {**cfg, "threads": 256, "block_n": 256, "min_ctas": 0, "stages": 2}
    assert any("one 64-row wgmma tile" in r for r in space.violations(wide, shape, SM90))


def _bf16_value(bits: int) -> float:
    """bf16 bit pattern (16 bits) -> its exact value (subnormals included)."""
    import struct

    return struct.unpack(">f", struct.pack(">I", (bits & 0xFFFF) << 16))[0]


def _bf16_bits_exact(x: float) -> int:
    """The bf16 bits of ``x``, which must be a bf16 (else the multiply it came from rounded): +-inf past the range."""
    import math
    import struct

    if math.isinf(x) or abs(x) >= 2.0**128:  # a product of two bf16 whose value needs >= 2^128 rounds (RN) to inf
        return 0x7F80 | (0x8000 if x < 0 else 0)
    f32 = struct.unpack(">I", struct.pack(">f", x))[0]
    assert f32 & 0xFFFF == 0 and struct.unpack(">f", struct.pack(">I", f32))[0] == x, f"{x!r} is not a bf16: rounded"
    return f32 >> 16


def _mul_bf16x2(a: int, b: int) -> int:
    """mul.rn.bf16x2 on bit patterns, for products that are exact (asserted) or overflow: no rounding is modelled."""
    lo = _bf16_bits_exact(_bf16_value(a) * _bf16_value(b))
    hi = _bf16_bits_exact(_bf16_value(a >> 16) * _bf16_value(b >> 16))
    return lo | (hi << 16)


def _fma_pair(w: int, sbyte: int, k: int) -> int:
    """Line-by-line model of csa2_fp4_pair_fma (tiles.indexer.dequant.FMA_PAIR_CUDA): bf16x2 of nibbles k, k + 4 of w."""
    m32 = 0xFFFFFFFF
    m1 = ((min(sbyte, 128) + 126) * 0x00800080) & m32  # bf16x2 2^(min(s, 128) - 1)
    m2 = ((max(sbyte, 128) - 1) * 0x00800080) & m32  # bf16x2 2^(max(s, 128) - 128)
    ww = w if k < 2 else ((w * (1 << 24)) >> 32)  # __umulhi(w, 2^24)
    x = ww & (0x00F000F0 if k & 1 else 0x000F000F)
    u = ((x * (0x104 if k & 1 else 0x1040)) & m32) & 0x81C081C0
    return _mul_bf16x2(_mul_bf16x2(u, m1), m2)


_FMA_PAIR_STATEMENTS = (  # csa2_fp4_pair_fma, in _fma_pair's order
    "const unsigned s = (unsigned)sbyte;",
    "const unsigned m1 = ((s < 128u ? s : 128u) + 126u) * 0x00800080u;",
    "const unsigned m2 = ((s > 128u ? s : 128u) - 1u) * 0x00800080u;",
    "const unsigned w = k < 2 ? (unsigned)w_ : __umulhi((unsigned)w_, 1u << 24);",
    "const unsigned x = w & ((k & 1) ? 0x00F000F0u : 0x000F000Fu);",
    "const unsigned u = (x * ((k & 1) ? 0x104u : 0x1040u)) & 0x81C081C0u;",
    "*(unsigned*)dst = csa2_mul_bf16x2(csa2_mul_bf16x2(u, m1), m2);",
)


def test_fma_rs_emulation_follows_the_cuda_source():
    """_fma_pair and _mul_bf16x2 are FMA_PAIR_CUDA's csa2_fp4_pair_fma and csa2_mul_bf16x2, statement by statement."""
    _assert_follows(ix_dequant.FMA_PAIR_CUDA, "csa2_fp4_pair_fma", _FMA_PAIR_STATEMENTS)
    _assert_follows(ix_dequant.FMA_PAIR_CUDA, "csa2_mul_bf16x2", ('asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));',))


# every code at every nibble position, plus random words
_ALL_CODE_WORDS = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x3F1E2D0C, 0xC0D1E2F3]


def _fma_group_values(words: list[int], sbyte: int) -> list[int]:
    """bf16 bits of the group's 8 x len(words) values (word-major, nibble order) as fma_rs builds them."""
    vals = {}
    for u, w in enumerate(words):
        for k in range(4):
            pair = _fma_pair(w, sbyte, k)
            vals[(u, k)], vals[(u, k + 4)] = pair & 0xFFFF, pair >> 16
    return [vals[(u, n)] for u in range(len(words)) for n in range(8)]


def test_fma_rs_decode_is_exact_for_every_code_and_scale_byte():
    """dequant=fma_rs (IMAD bit placement, two bf16 multiplies): for every scale byte 0..254 (the compressor writes
    1..254, out-of-range rows read 0) and every code at every nibble position, each multiply is exact (asserted by the
    model) and the bf16 equals the reference value (model.formats, fp32 -> bf16, inf where it overflows); and equals
    prmt_rs's A operand bit for bit on the bits formula's range 2..252 (prmt_rs rounds code +-1 to +-0 at byte 1)."""
    import random

    from model import formats

    rng = random.Random(7)
    for sbyte in range(255):
        words = _ALL_CODE_WORDS + [rng.getrandbits(32) for _ in range(2)]
        got = _fma_group_values(words, sbyte)
        packed = torch.tensor([[(w >> (8 * b)) & 0xFF for w in words for b in range(4)]], dtype=torch.uint8)  # [1, 32]
        ref = formats.fp4_dequantize(packed, torch.tensor([[sbyte, sbyte]], dtype=torch.uint8), 32, "e8m0")
        want = (ref.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).view(-1).tolist()
        assert got == want, sbyte
        if 2 <= sbyte <= 252:
            prmt = []
            for g in range(0, len(words), 4):
                prmt += [(v >> (16 * h)) & 0xFFFF for v in _prmt_group(words[g : g + 4], sbyte) for h in range(2)]
            assert got == prmt, sbyte
    assert _fma_group_values([0, 0, 0, 0], 0) == [0] * 32  # zero-filled out-of-range rows


def test_fma_rs_dim_order_pairs_nibble_k_with_k_plus_4_of_one_word():
    """fma_rs: _rs_fma_dim is a permutation; under the wgmma A layout each thread's 32 columns of a row are one scale
    group, and each A register (c, c + 1) holds dims d, d + 4: nibbles k and k + 4 of one packed word (bits 4k and
    4k + 16, the two bf16 halves' distance), which is what csa2_fp4_pair_fma writes."""
    assert sorted(ix_dequant._rs_fma_dim(c) for c in range(128)) == list(range(128))
    for t in range(128):
        for row in range(64):
            cols = [c for c in range(128) if _wgmma_a_owner(row, c)[0] == t]
            if cols:
                dims = sorted(ix_dequant._rs_fma_dim(c) for c in cols)
                assert dims == list(range(dims[0], dims[0] + 32)) and dims[0] % 32 == 0
    for c in range(0, 128, 2):
        d = ix_dequant._rs_fma_dim(c)
        assert ix_dequant._rs_fma_dim(c + 1) == d + 4 and d % 8 < 4  # nibble k of word d // 8 and nibble k + 4


def test_fma_rs_fragment_emulation_equals_the_reference_dot_products():
    """CPU emulation of one 64-row tile of the fma_rs kernel: each thread fills its A registers by the kernel's rule
    (element (i, c), c even: word 4t + j // 4 with t = (c % 8) // 2, j = c // 8, nibbles j % 4 and j % 4 + 4, scale
    byte t), read back through the wgmma layout: A == K[:, perm] bit for bit and A @ q_s^T == K @ q^T exactly."""
    import random

    rng = random.Random(3)
    rows = 64
    words = [[rng.getrandbits(32) for _ in range(16)] for _ in range(rows)]  # [64, 16]
    # both sides of 128 (one bf16 multiply or two), spread <= 32 binades so the float64 sums below stay exact
    sbytes = [[rng.choice([110, 120, 127, 128, 129, 135, 141]) for _ in range(4)] for _ in range(rows)]  # [64, 4]
    regs = {}
    for i in range(rows):
        for c in range(0, 128, 2):
            t, j = (c % 8) // 2, c // 8
            pair = _fma_pair(words[i][4 * t + j // 4], sbytes[i][t], j % 4)
            thread, slot = _wgmma_a_owner(i, c)
            regs[(thread, slot)], regs[(thread, slot + 1)] = pair & 0xFFFF, pair >> 16
    frag = torch.tensor([[regs[_wgmma_a_owner(i, c)] for c in range(128)] for i in range(rows)], dtype=torch.int32)
    a = (frag << 16).view(torch.float32).double()  # [64, 128] in fragment column order
    codes = torch.tensor([[(w >> (4 * n)) & 0xF for w in ws for n in range(8)] for ws in words], dtype=torch.int32)
    scale = torch.tensor(sbytes, dtype=torch.int32).repeat_interleave(32, dim=1)  # [64, 128]
    k = _bits_dequant(codes, scale).double()  # [64, 128] K in dim order
    perm = torch.tensor([ix_dequant._rs_fma_dim(c) for c in range(128)])
    assert torch.equal(a, k[:, perm])
    q = torch.randint(-6, 7, (32, 128)).double() * 0.5  # [32, 128]
    assert torch.equal(a @ q[:, perm].T, k @ q.T)


def _fma_source_reads(src: str, threads: int, producer: int) -> dict:
    """The generated fma_rs dequant call evaluated per consumer thread and A slot (pipeline stage 0):
    {(thread, slot): (row of the packed word, word, row of the scale, scale byte, k)} for the even slots it writes."""

    dst, word, sbyte, k_e = _call_args(src, "csa2_fp4_pair_fma")
    var = re.fullmatch(r"\(&\(k_deq\[(\w+)\]\)\)", dst).group(1)
    word_e = re.fullmatch(r"\(\(int\*\)kw_s\)\[(.*)\]", word).group(1)
    row_e, shift_e = re.fullmatch(r"\(\(\(\(int\*\)ks_s\)\[(.*)\] >> (.*)\) & 255\)", sbyte).groups()
    return _per_thread_reads(src, var, (word_e, row_e, shift_e, k_e), threads, producer)


@pytest.mark.parametrize(
    "cfg,gather",
    [
        ({"dequant": "fma_rs", "min_ctas": 2}, False),
        ({"dequant": "fma_rs", "threads": 128, "block_n": 64, "min_ctas": 4, "stages": 4}, False),
        ({"dequant": "fma_rs", "threads": 128, "block_n": 128, "min_ctas": 3, "stages": 4}, False),
        ({"dequant": "fma_rs", "min_ctas": 2}, True),
    ],
    ids=["t256_bn128", "t128_bn64", "t128_bn128", "gather_t256"],
)
@pytest.mark.slow
def test_fma_rs_generated_dequant_covers_every_pair_once_one_group_per_thread(cfg, gather):
    """The CUDA TileLang generates for the fma_rs dequant, evaluated for every consumer thread: every (row, word, k) of
    the tile converted exactly once (k: nibbles k and k + 4), with the scale byte of the word's own group and row, one
    scale group per thread and row; the pair's fragment slot is the one the emulation above fills."""
    tile = ix.REINDEX_TOPK if gather else ix.INDEXER_TOPK
    full = {**tile.default_config(SM90), **cfg}
    src = ix_launch.build_score(SM90, full, gather, 8, *DECODE_GRID).get_kernel_source()
    assert "csa2_fp4_table_word" not in src and "rs_tab" not in src  # no table: the scale is two bf16 multiplies
    reads = _fma_source_reads(src, full["threads"], 0 if gather else full["threads"])
    _assert_every_pair_once_one_group_per_thread(reads, full["block_n"])


def test_fma_rs_compiles_with_register_split_and_is_constrained_like_prmt_rs():
    """fma_rs on two warpgroups at 2 CTAs per SM: RS wgmma, setmaxnreg 24 / 104, no shared table (4 KiB less than prmt_rs),
    q loaded in the _rs_fma_dim order; the same register and fragment-row constraints as prmt_rs."""
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    space = ix.INDEXER_TOPK.search_space(SM90)
    cfg = {**ix.INDEXER_TOPK.default_config(SM90), **TWO_WARPGROUPS, "epilogue": "hoisted", "dequant": "fma_rs"}
    assert space.violations(cfg, shape, SM90) == []
    src = ix_launch.build_score(SM90, cfg, False, 8, *DECODE_GRID).get_kernel_source()
    assert "wgmma_rs" in src and "wgmma_ss" not in src and "mul.rn.bf16x2" in src and "csa2_fp4_pair_bf16" not in src
    assert "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<104>" in src
    two_mtiles = {**cfg, "threads": 128, "block_n": 128, "stages": 4}
    assert any("fma_rs" in r for r in space.violations({**two_mtiles, "min_ctas": 4}, shape, SM90))  # ptxas: 16 B spill
    assert space.violations({**two_mtiles, "min_ctas": 3}, shape, SM90) == []
    wide = {**cfg, "block_n": 256, "min_ctas": 0, "tiles_per_cta": 4}
    assert any("one 64-row wgmma tile" in r for r in space.violations(wide, shape, SM90))


# dequant="prmt_rs2" (session 8, written without device time): prmt_rs's A registers bit for bit, the high-half
# selectors by mul.hi (IMAD.HI, FMA pipe) and the scale byte by one byte permute.
def _rs_pair2(w: int, tables: list[int], k: int) -> int:
    """Line-by-line model of csa2_fp4_pair2_bf16 (tiles.indexer.dequant.PRMT_PAIR2_CUDA), each PTX op on Python ints."""
    m32 = 0xFFFFFFFF
    lo0, lo1, hi0, hi1 = tables
    w &= m32
    m = w & 0x77777777  # lop3: the magnitude selectors
    w4 = (w << 4) & m32  # shl (IMAD.SHL)
    if k < 2:
        sel, gather = m & 0xFFFF, _prmt(w, w4, 0x1504)  # prmt reads the selector's low 16 bits
    else:
        sel, gather = (m * 65536) >> 32, _prmt(w, w4, 0x3726)  # mul.hi.u32 m, 2^16 (IMAD.HI)
    lo = _prmt(lo0, lo1, sel)
    hi = _prmt(hi0, hi1, sel) | (gather & 0x80808080)  # lop3 merge
    return _prmt(lo, hi, 0x7362 if k & 1 else 0x5140)


def _scale_byte2(sw: int, t: int) -> int:
    """Model of csa2_scale_byte: prmt(sw, 0, 0x4440 | t), byte t of the scale word zero-extended."""
    return _prmt(sw & 0xFFFFFFFF, 0, 0x4440 | t)


def test_prmt_rs2_emulation_follows_the_cuda_source():
    """_rs_pair2 is PRMT_PAIR2_CUDA's csa2_fp4_pair2_bf16 (prmt_rs's statements, mh = csa2_hi16(m), a mul.hi by 2^16),
    and _scale_byte2 its csa2_scale_byte; the tables are prmt_rs's (PRMT_PAIR2_CUDA starts with PRMT_PAIR_CUDA)."""
    src = ix_dequant.PRMT_PAIR2_CUDA
    assert src.startswith(ix_dequant.PRMT_PAIR_CUDA)
    _assert_follows(src, "csa2_fp4_pair2_bf16", (*_RS_PAIR_STATEMENTS, "} else { const unsigned mh = csa2_hi16(m); l = csa2_prmt"))
    _assert_follows(src, "csa2_hi16", ('asm("mul.hi.u32 %0, %1, 65536;" : "=r"(d) : "r"(x));',))
    _assert_follows(src, "csa2_scale_byte", ("return (int)csa2_prmt((unsigned)sw, 0u, 0x4440u | (unsigned)t);",))


def test_prmt_rs2_pairs_equal_prmt_rs_for_every_code_position_and_scale_byte():
    """dequant=prmt_rs2 builds prmt_rs's A registers bit for bit: every code (0..15, both zeros and the sign) in every
    nibble position of a word, random words, every k, at every scale byte 0..255 (the table the kernel indexes has all
    256 rows; bytes 253..255 and 0 give prmt_rs's own patterns there, whatever they are); and against the reference
    decoder (the bits formula) for scale bytes 1..252 (byte 1: code +-1 -> +-0, the prmt paths' convention). The scale
    byte extraction equals (word >> 8t) & 0xFF for every byte value and position, sign bit included."""
    import random

    rng = random.Random(8)
    every_code = [c * 0x11111111 for c in range(16)] + [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x80000000, 0x08]
    for sbyte in range(256):
        tables = _rs_tables(sbyte)
        words = every_code + [rng.getrandbits(32) for _ in range(8)]
        got = [_rs_pair2(w, tables, k) for w in words for k in range(4)]
        assert got == [_rs_pair(w, tables, k) for w in words for k in range(4)], sbyte
        if 1 <= sbyte <= 252:
            codes = torch.tensor([(w >> (4 * j)) & 0xF for w in words for j in range(8)], dtype=torch.int32)
            want = (_bits_dequant(codes, torch.full_like(codes, sbyte)).view(torch.int32) >> 16) & 0xFFFF
            if sbyte == 1:
                want = torch.where((codes & 7) == 1, (codes & 8) << 12, want)
            assert [(g >> (16 * h)) & 0xFFFF for g in got for h in range(2)] == want.tolist(), sbyte
    for sw in [0, 0xFFFFFFFF, 0x80000000, 0x7F7F7F7F] + [rng.getrandbits(32) for _ in range(2000)]:
        for t in range(4):
            assert _scale_byte2(sw, t) == (sw >> (8 * t)) & 0xFF
    # the zero words of an out-of-range row (TMA fill: words and scales 0; gather fill: scales 0x7F7F7F7F) give +0
    assert [_rs_pair2(0, _rs_tables(_scale_byte2(sw, 0)), k) for sw in (0, 0x7F7F7F7F) for k in range(4)] == [0] * 8


def test_prmt_rs2_fragment_emulation_equals_the_reference_dot_products():
    """The prmt_rs fragment emulation with prmt_rs2's per-register rule (its scale byte and pair models): the A tile read
    back through the wgmma layout is K in the _rs_dim order and A @ q_s^T equals K @ q^T exactly."""
    import random

    rng = random.Random(5)
    rows = 64
    words = [[rng.getrandbits(32) for _ in range(16)] for _ in range(rows)]
    swords = [sum(rng.randint(100, 140) << (8 * t) for t in range(4)) for _ in range(rows)]  # as prmt_rs's emulation
    regs = {}
    for i in range(rows):
        for c in range(0, 128, 2):
            t, j = (c % 8) // 2, c // 8
            pair = _rs_pair2(words[i][4 * t + j // 4], _rs_tables(_scale_byte2(swords[i], t)), j % 4)
            thread, slot = _wgmma_a_owner(i, c)
            regs[(thread, slot)], regs[(thread, slot + 1)] = pair & 0xFFFF, pair >> 16
    frag = torch.tensor([[regs[_wgmma_a_owner(i, c)] for c in range(128)] for i in range(rows)], dtype=torch.int32)
    a = (frag << 16).view(torch.float32).double()
    codes = torch.tensor([[(w >> (4 * n)) & 0xF for w in ws for n in range(8)] for ws in words], dtype=torch.int32)
    sb = torch.tensor([[(sw >> (8 * t)) & 0xFF for t in range(4)] for sw in swords], dtype=torch.int32)
    k = _bits_dequant(codes, sb.repeat_interleave(32, dim=1)).double()
    perm = torch.tensor([ix_dequant._rs_dim(c) for c in range(128)])
    assert torch.equal(a, k[:, perm])
    q = torch.randint(-6, 7, (32, 128)).double() * 0.5
    assert torch.equal(a @ q[:, perm].T, k @ q.T)


# The kernel's rule the three fragment emulations above fill their registers by, in the macros that build the A fragment
_FRAGMENT_RULE = ("for i, c in T.Parallel(block_n, D): if c % 2 == 0: t, j = (c % 8) // 2, c // 8",)
_FRAGMENT_STATEMENTS = {
    "dequant_fragment_prmt": (
        *_FRAGMENT_RULE,
        "sb = (ks_s[i] >> (t * 8)) & 0xFF",
        "tables = (tab[sb, 0], tab[sb, 1], tab[sb, 2], tab[sb, 3])",
        'T.call_extern("handle", "csa2_fp4_pair_bf16", T.address_of(k_deq[i, c]), kw_s[i, t * 4 + j // 4], *tables, j % 4)',
    ),
    "dequant_fragment_prmt2": (
        *_FRAGMENT_RULE,
        'sb = T.call_extern("int32", "csa2_scale_byte", ks_s[i], t)',
        "tables = (tab[sb, 0], tab[sb, 1], tab[sb, 2], tab[sb, 3])",
        'T.call_extern("handle", "csa2_fp4_pair2_bf16", T.address_of(k_deq[i, c]), kw_s[i, t * 4 + j // 4], *tables, j % 4)',
    ),
    "dequant_fragment_fma": (
        *_FRAGMENT_RULE,
        "sb = (ks_s[i] >> (t * 8)) & 0xFF",
        'T.call_extern("handle", "csa2_fp4_pair_fma", T.address_of(k_deq[i, c]), kw_s[i, t * 4 + j // 4], sb, j % 4)',
    ),
}


@pytest.mark.parametrize("macro", list(_FRAGMENT_STATEMENTS))
def test_fragment_emulations_follow_the_tilelang_source(macro):
    """The fragment emulations' per-register rule (word, scale byte, pair index of element (i, c)) is the macro's."""
    src = _python_function(ix_dequant, macro)
    for stmt in _FRAGMENT_STATEMENTS[macro]:
        assert stmt in src, stmt


def _kernel_lines_but_dequant(src: str) -> list[str]:
    """The kernel's lines (after the imported helpers) without the dequant call lines of prmt_rs / prmt_rs2."""
    body = src[src.index('extern "C"') :].splitlines()
    return [ln for ln in body if not any(f in ln for f in ("csa2_fp4_pair_bf16(", "csa2_fp4_pair2_bf16(", "csa2_scale_byte("))]


def _rs2_source_reads(src: str, threads: int, producer: int) -> dict:
    """The generated prmt_rs2 dequant (csa2_scale_byte, then csa2_fp4_pair2_bf16 on the table row it names), evaluated
    per consumer thread and A slot: {(thread, slot): (row of the packed word, word, row of the scale, scale byte, k)}."""

    sw, t_e = _call_args(src, "csa2_scale_byte")
    row_e = re.fullmatch(r"\(\(int\*\)ks_s\)\[(.*)\]", sw).group(1)
    dst, word, *tabs, k_e = _call_args(src, "csa2_fp4_pair2_bf16")
    var = re.fullmatch(r"\(&\(k_deq\[(\w+)\]\)\)", dst).group(1)
    word_e = re.fullmatch(r"\(\(int\*\)kw_s\)\[(.*)\]", word).group(1)
    assert tabs[0] == "((uint*)rs_tab)[(((int64_t)sb) * (int64_t)4)]"  # the row of the byte just extracted
    assert tabs[1:] == [f"((uint*)rs_tab)[((((int64_t)sb) * (int64_t)4) + (int64_t){e})]" for e in (1, 2, 3)]
    return _per_thread_reads(src, var, (word_e, row_e, f"({t_e}) * 8", k_e), threads, producer)


@pytest.mark.parametrize(
    "cfg,gather",
    [
        ({}, False),  # the Hopper default's layout: one warpgroup, 256 entries (4 m-tiles), fused epilogue
        ({"epilogue": "hoisted"}, False),
        ({"block_n": 64, "min_ctas": 4, "stages": 4}, False),
        ({**TWO_WARPGROUPS, "epilogue": "hoisted"}, False),
        ({}, True),  # Reindex's gathered variant (not warp-specialised)
    ],
    ids=["default_fused", "default_hoisted", "bn64_mc4", "t256_bn128_hoisted", "gather_bn256"],
)
@pytest.mark.slow
def test_prmt_rs2_generated_dequant_covers_every_pair_once_one_group_per_thread(cfg, gather):
    """The CUDA TileLang generates for prmt_rs2, evaluated for every consumer thread: every (row, word, k) converted once,
    the table row of the word's own row and group, one scale group per thread and row; the rest of the kernel (q load,
    tables, wgmma, epilogue) is prmt_rs's: the two sources differ only in the dequant call lines and the helpers."""
    tile = ix.REINDEX_TOPK if gather else ix.INDEXER_TOPK
    full = {**tile.default_config(SM90), "dequant": "prmt_rs2", **cfg}
    if gather:
        full.update(block_n=256, threads=128, stages=1, tiles_per_cta=16, min_ctas=2, epilogue="fused")
    assert tile.search_space(SM90).violations(full, tile.shapes()[0], SM90) == []
    src = ix_launch.build_score(SM90, full, gather, 8, *DECODE_GRID).get_kernel_source()
    assert "csa2_fp4_pair_bf16(" not in src[src.index('extern "C"') :] and "wgmma_rs" in src
    reads = _rs2_source_reads(src, full["threads"], 0 if gather else full["threads"])
    _assert_every_pair_once_one_group_per_thread(reads, full["block_n"])
    old = ix_launch.build_score(SM90, {**full, "dequant": "prmt_rs"}, gather, 8, *DECODE_GRID).get_kernel_source()
    assert _kernel_lines_but_dequant(src) == _kernel_lines_but_dequant(old)


@pytest.mark.parametrize("epilogue", ["fused", "hoisted"])
@pytest.mark.slow
def test_prmt_rs2_builds_at_the_indexer_shapes_without_spills(epilogue, tmp_path):
    """prmt_rs2 on the Hopper default's layout (256 entries, one warpgroup, one stage, 2 CTAs per SM) with either
    epilogue: valid and built (score + select) at decode B=64 x 128K, decode B=1 x 128K and prefill 4K; ptxas keeps the
    score kernel within __launch_bounds__(256, 2) (<= 128 registers) with no spill."""
    cfg = {**ix.INDEXER_TOPK.default_config(SM90), "dequant": "prmt_rs2", "epilogue": epilogue}
    for name in ("decode_b64_n128k", "decode_b1_n128k", "prefill_s4k"):
        shape = ix.INDEXER_TOPK.shape(name)
        assert ix.INDEXER_TOPK.search_space(SM90).violations(cfg, shape, SM90) == []
        sources = ix.INDEXER_TOPK.kernel_sources(shape, cfg, SM90)
        _assert_rs_score_kernel(sources["score"], "prmt_rs2", epilogue, shape, cfg)
        assert "csa2_rs::select_row<" in _kernel_part(sources["select"]), name
    src = ix_launch.build_score(SM90, cfg, False, 8, *DECODE_GRID).get_kernel_source()
    assert "__launch_bounds__(256, 2)" in src and "mul.hi.u32" in src
    regs, spills = _ptxas(src, tmp_path)
    assert regs <= 128 and spills == 0, (regs, spills)


def test_prmt_rs2_is_a_hopper_only_search_space_option():
    """In both score tiles' spaces: prmt_rs2 with the RS layouts and epilogues on Hopper, constrained like prmt_rs (two
    m-tiles per warpgroup at min_ctas 4 pruned; fragment rows), refused on sm80 (constraint and kernel builder); the
    defaults do not use it and their dequant choices are unchanged."""
    sm80 = get_arch("sm80")
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    for tile in (ix.INDEXER_TOPK, ix.REINDEX_TOPK):
        space = tile.search_space(SM90)
        assert "prmt_rs2" in {p.name: p.choices for p in space.params}["dequant"]
        base = tile.default_config(SM90)
        for epi in ("per_tile", "hoisted"):
            assert space.violations({**base, **TWO_WARPGROUPS, "dequant": "prmt_rs2", "min_ctas": 2, "epilogue": epi}, shape, SM90) == []
        two_mtiles = {**base, "dequant": "prmt_rs2", "threads": 128, "block_n": 128, "stages": 4, "epilogue": "hoisted"}
        assert any("prmt_rs2" in r for r in space.violations({**two_mtiles, "min_ctas": 4}, shape, SM90))
        why = tile.search_space(sm80).violations({**tile.default_config(sm80), "dequant": "prmt_rs2"}, shape, sm80)
        assert any("Hopper" in r for r in why)
        assert tile.default_config(SM90)["dequant"] != "prmt_rs2" and tile.default_config(sm80)["dequant"] != "prmt_rs2"
    with pytest.raises(ValueError, match="sm_90a only"):
        ix_score_kernel.build_score_kernel(sm80.nvcc_arch, 128, 128, 1, 16, "prmt_rs2", False, 8, 0, "per_tile")


HOISTED_BUILDS = {
    "prmt_rs_mc2": ({"dequant": "prmt_rs", "min_ctas": 2}, False),
    "prmt_rs_two_warpgroups_mc2": ({**TWO_WARPGROUPS, "dequant": "prmt_rs", "min_ctas": 2}, False),
    "prmt_rs_t128_bn64_mc4": ({"dequant": "prmt_rs", "threads": 128, "block_n": 64, "min_ctas": 4, "stages": 4}, False),
    "prmt_rs_t128_bn128_mc3": ({"dequant": "prmt_rs", "threads": 128, "block_n": 128, "min_ctas": 3, "stages": 4}, False),
    "fma_rs_mc2": ({"dequant": "fma_rs", "min_ctas": 2}, False),
    "gather_prmt_rs_mc2": ({"dequant": "prmt_rs", "min_ctas": 2}, True),
}


def _tile_loop(src: str) -> str:
    """The CUDA of the (consumer) tile loop: from its header to the end of the kernel (it is the kernel's last loop)."""
    return src[max(src.rindex("for (int t = 0;"), src.rfind("for (int t_1 = 0;")) :]


@pytest.mark.parametrize("name", list(HOISTED_BUILDS))
@pytest.mark.slow
def test_hoisted_epilogue_keeps_per_cta_work_out_of_the_tile_loop(name):
    """epilogue=hoisted: w / 2 is loaded into registers once per CTA (no w_s, no weights read or 0.5 multiply inside
    the tile loop), the stores index the CTA's pinned output pointer (no int64 index of ``out`` in the loop), and the
    q_s / table writes of every thread are behind a CTA barrier before the consumers' branch. per_tile, the same
    config, has all three inside the loop (the check would see them)."""
    cfg, gather = HOISTED_BUILDS[name]
    tile = ix.REINDEX_TOPK if gather else ix.INDEXER_TOPK
    full = {**tile.default_config(SM90), **cfg, "epilogue": "hoisted"}
    assert tile.search_space(SM90).violations(full, tile.shapes()[0], SM90) == []
    # hidden_tiles=score: skip's -inf fill of the span's tail indexes ``out`` after the loop, which _tile_loop's
    # "to the end of the kernel" would count as inside it (the epilogue is the same either way)
    full = {**full, "hidden_tiles": "score"} if not gather else full
    src = ix_launch.build_score(SM90, full, gather, 8, *DECODE_GRID).get_kernel_source()
    loop = _tile_loop(src)
    assert "void* w_s" not in src and "float w_half[8];" in src and "csa2_pin_ptr(" in src
    assert "weights" not in loop and "0x1p-1f" not in loop and "out[" not in loop and "out_cta)[" in loop
    head = src[: src.index("tl::warpgroup_reg_dealloc")] if not gather else src[: src.index("for (int t = 0;")]
    assert head.rindex("__syncthreads();") > head.rindex("q_s)")  # after the last q_s write, before any consumer read
    old = _tile_loop(ix_launch.build_score(SM90, {**full, "epilogue": "per_tile"}, gather, 8, *DECODE_GRID).get_kernel_source())
    assert "((float*)w_s)" in old and "0x1p-1f" in old and "out[" in old


def test_hoisted_epilogue_is_an_rs_only_search_space_option():
    """In both score tiles' search spaces, pruned for the shared-tile dequants (their epilogue keeps the TMA'd w_s),
    refused by the kernel builder there too; every default names per_tile (the kernel it built before the option)."""
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    for tile in (ix.INDEXER_TOPK, ix.REINDEX_TOPK):
        space = tile.search_space(SM90)
        assert {p.name: p.choices for p in space.params}["epilogue"] == ("per_tile", "hoisted", "fused")
        base = tile.default_config(SM90)
        for dequant in ix.RS_DEQUANTS:
            assert space.violations({**base, "dequant": dequant, "min_ctas": 2, "epilogue": "hoisted"}, shape, SM90) == []
        assert any("epilogue" in r for r in space.violations({**base, "dequant": "prmt", "epilogue": "hoisted"}, shape, SM90))
        assert space.violations({**base, "dequant": "prmt", "epilogue": "per_tile"}, shape, SM90) == []
    # the indexer's Hopper default hoists (profile_queued_session6.json), fused since session 8; the reindex default
    # (prmt) cannot; two consumer warpgroups picked alone fall back to hoisted
    assert ix.INDEXER_TOPK.default_config(SM90)["epilogue"] == "fused"
    assert ix.INDEXER_TOPK.with_defaults(SM90, {"threads": 256, "block_n": 128})["epilogue"] == "hoisted"
    assert ix.REINDEX_TOPK.default_config(SM90)["epilogue"] == "per_tile"
    assert ix.INDEXER_TOPK.default_config(get_arch("sm80"))["epilogue"] == "per_tile"
    assert ix.INDEXER_TOPK.with_defaults(SM90, {"dequant": "prmt"})["epilogue"] == "per_tile"
    with pytest.raises(ValueError, match="hoisted"):
        ix_score_kernel.build_score_kernel(SM90.nvcc_arch, 128, 256, 2, 16, "bits", False, 8, 0, "hoisted")


@pytest.mark.parametrize("shape_name", ["decode_b64_n128k", "decode_b1_n128k", "prefill_s4k"])
@pytest.mark.slow
def test_hoisted_epilogue_builds_at_the_indexer_shapes(shape_name):
    """The default config with epilogue=hoisted, prmt_rs and fma_rs: score and select kernels for sm_90a."""
    shape = ix.INDEXER_TOPK.shape(shape_name)
    for dequant in ix.RS_DEQUANTS:
        cfg = {**ix.INDEXER_TOPK.default_config(SM90), "dequant": dequant, "epilogue": "hoisted"}
        assert ix.INDEXER_TOPK.search_space(SM90).violations(cfg, shape, SM90) == []
        sources = ix.INDEXER_TOPK.kernel_sources(shape, cfg, SM90)
        _assert_rs_score_kernel(sources["score"], dequant, "hoisted", shape, cfg)
        assert "csa2_rs::select_row<" in _kernel_part(sources["select"]), dequant


# The helper each RS dequant calls in the tile loop to build its A fragment.
RS_PAIR_HELPERS = {"prmt_rs": "csa2_fp4_pair_bf16(", "fma_rs": "csa2_fp4_pair_fma(", "prmt_rs2": "csa2_fp4_pair2_bf16("}


def _assert_rs_score_kernel(src: str, dequant: str, epilogue: str, shape, cfg: dict) -> None:
    """The score kernel of an RS dequant as built for ``shape``: the dequant's own pair helper (no other's) into RS
    wgmmas, the epilogue's (hoisted: the pinned output pointer; fused: also the hand-written store), and the tile loop
    bounded by the tiles per CTA that "auto" resolves to at the shape."""
    kernel = _kernel_part(src)
    assert [d for d, helper in RS_PAIR_HELPERS.items() if helper in kernel] == [dequant]
    assert "wgmma_rs" in kernel and "wgmma_ss" not in kernel
    assert ("csa2_pin_ptr(" in kernel, "csa2_relu_wsum_store<" in kernel) == (True, epilogue == "fused")
    tiles = ix.resolve_tiles_per_cta(cfg["tiles_per_cta"], shape["B"] * shape["S"], shape["N"], cfg["block_n"], SM90)
    assert f"for (int t = 0; t < max(0, min({tiles}, " in kernel, (shape.name, tiles)


# hidden_tiles=skip (session 17): the contiguous score kernel's tile loop ends at the last tile with a visible entry.


@pytest.mark.parametrize("rows, n", [(4096, 4096), DECODE_GRID, (1, 131072)], ids=["prefill_s4k", "decode_b64", "decode_b1"])
@pytest.mark.slow
def test_hidden_tiles_skip_bounds_the_tile_loop(rows, n, tmp_path):
    """hidden_tiles=skip (the Hopper default since session 17): both roles' tile loops end at ceil((nvis - span start)
    / block_n) (at most tiles_per_cta), the rest of the span is written -inf after the loop; no spills. "score" builds
    the kernel of before the option (the same cached object as a config without the key)."""
    cfg = ix.INDEXER_TOPK.default_config(SM90)
    assert cfg["hidden_tiles"] == "skip" and ix.INDEXER_TOPK.default_config(get_arch("sm80"))["hidden_tiles"] == "score"
    src = ix_launch.build_score(SM90, cfg, False, 8, rows, n).get_kernel_source()
    loops = [line for line in src.splitlines() if line.strip().startswith("for (int t") and "nvis" in line]
    assert len(loops) == 2, loops  # producer and consumer
    assert "-CUDART_INF_F" in src
    assert resource_usage(src, tmp_path, SM90.nvcc_arch)[1] == 0
    without = {k: v for k, v in cfg.items() if k != "hidden_tiles"}
    assert ix_launch.build_score(SM90, without, False, 8, rows, n) is ix_launch.build_score(
        SM90, {**cfg, "hidden_tiles": "score"}, False, 8, rows, n
    )


def test_hidden_tiles_is_an_indexer_option():
    """In the indexer's space (not Reindex's: its candidate slots are not in position order, the builder ignores it
    there); the kernel builder refuses skip for the gathered variant and unknown values."""
    assert {p.name: p.choices for p in ix.INDEXER_TOPK.search_space(SM90).params}["hidden_tiles"] == ("score", "skip")
    assert "hidden_tiles" not in {p.name for p in ix.REINDEX_TOPK.search_space(SM90).params}
    with pytest.raises(ValueError, match="hidden_tiles"):
        ix_score_kernel.build_score_kernel(SM90.nvcc_arch, 128, 256, 2, 16, "prmt", True, 8, 2, "per_tile", "skip")
    with pytest.raises(ValueError, match="hidden_tiles"):
        ix_score_kernel.build_score_kernel(SM90.nvcc_arch, 128, 256, 2, 16, "prmt", False, 8, 2, "per_tile", "some")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["default", "bn128_t256"])
def test_hidden_tiles_skip_matches_reference(layout):
    """hidden_tiles=skip against the reference: causal prefill (half the tiles skipped), decode (the last tiles of
    short rows), odd shapes with rows that see nothing or fewer than top-k entries."""
    arch = get_arch("sm90")
    over = {} if layout == "default" else {**TWO_WARPGROUPS, "epilogue": "hoisted"}
    cfg = ix.INDEXER_TOPK.with_defaults(arch, {"hidden_tiles": "skip", **over})
    for shape in [
        ix.INDEXER_TOPK.shape("prefill_s4k"),
        ix.INDEXER_TOPK.shape("decode_b64_n32k"),
        _odd(3, 2, 1000),
        _odd(2, 1, 77),
        _odd(1, 3, 4099),
    ]:
        ev = evaluate(ix.INDEXER_TOPK, shape, cfg, arch, seed=13, time_it=False)
        assert ev.outcome == OK, f"{layout} {shape.name}: {ev.message}"


# dequant=fp8_rs (session 17): the E2M1 codes shifted into E4M3 bytes, one FP8 wgmma per scale group, the group sums
# scaled by their E8M0 scales in the epilogue.


def _fp8_word_model(w: int, half: int) -> int:
    """csa2_fp8_word's bit operations on a packed word (Python ints, 32 bits)."""
    if half:
        return (w & 0x80808080) | ((w >> 2) & 0x1C1C1C1C)
    return ((w << 4) & 0x80808080) | ((w << 2) & 0x1C1C1C1C) & 0xFFFFFFFF


def _fp8_q_factor_model(amax: float) -> float:
    """csa2_fp8_q_factor's arithmetic on an fp32 amax >= 0."""
    e = int(torch.tensor([amax]).view(torch.int32).item()) >> 23
    return 1.0 if e == 0 else 2.0 ** (min(254, max(1, 261 - e)) - 127)


def test_fp8_rs_emulation_follows_the_cuda_source():
    """_fp8_word_model and _fp8_q_factor_model are FP8_CUDA's csa2_fp8_word and csa2_fp8_q_factor, statement by statement."""
    word = "*(unsigned*)dst = half ? (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu) : ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);"
    _assert_follows(ix_dequant.FP8_CUDA, "csa2_fp8_word", ("const unsigned w = (unsigned)w_;", word))
    factor = (
        "const int e = (int)(__float_as_uint(amax) >> 23);",
        "return e == 0 ? 1.0f : __uint_as_float((unsigned)min(254, max(1, 261 - e)) << 23);",
    )
    _assert_follows(ix_dequant.FP8_CUDA, "csa2_fp8_q_factor", factor)


def test_fp8_word_places_every_e2m1_code_exactly():
    """Every E2M1 code in every nibble: csa2_fp8_word's E4M3 bytes decode (torch float8_e4m3fn) to the code's value x
    2^-6, byte j of half h holding nibble 2j + h (the dims _fp8_dim gives q)."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (512,), generator=gen, dtype=torch.int64).tolist() + [0x76543210, 0xFEDCBA98]
    for w in words:
        for half in (0, 1):
            out = _fp8_word_model(w, half)
            got = torch.tensor([(out >> (8 * j)) & 0xFF for j in range(4)], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            for j in range(4):
                code = (w >> (4 * (2 * j + half))) & 0xF
                want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7] * 2.0**-6
                assert got[j].item() == want, (hex(w), half, j)
    assert sorted(ix_dequant._fp8_dim(g, c) for g in range(4) for c in range(32)) == list(range(128))
    assert [ix_dequant._fp8_dim(0, c) for c in (0, 1, 15, 16, 17)] == [0, 2, 30, 1, 3]  # even nibbles low, odd ones high


def test_fp8_q_factor_puts_each_head_max_in_range():
    """csa2_fp8_q_factor (mirrored): 2^(261 - e) for amax's biased exponent e, so amax x factor is in [128, 256); 1 for a
    zero head."""
    for amax in [2.0**-20, 0.0123, 0.5, 1.0, 5.99, 6.0, 1000.0]:
        assert 128.0 <= amax * _fp8_q_factor_model(amax) < 256.0
    assert _fp8_q_factor_model(0.0) == 1.0


@pytest.mark.parametrize(
    "name, cfg", [("bn128_mc2", {"block_n": 128, "min_ctas": 2}), ("bn64_mc3", {"block_n": 64, "min_ctas": 3, "stages": 3})]
)
@pytest.mark.parametrize("gather", [False, True], ids=["contiguous", "gather"])
@pytest.mark.slow
def test_fp8_rs_builds_four_fp8_wgmmas_without_spills(name, cfg, gather, tmp_path):
    """fp8_rs: per tile four k32 E4M3 wgmmas from registers with one wait, the combine (which reads the stage's scale
    words) before the consumer releases the stage, the fused store; ptxas: no spills, no serialised wgmma."""
    full = {**ix.INDEXER_TOPK.default_config(SM90), "dequant": "fp8_rs", **cfg}
    src = ix_launch.build_score(SM90, full, gather, 8, *DECODE_GRID).get_kernel_source()
    assert src.count("tl::wgmma_rs<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 32, 32") == 4
    loop = src[src.index("csa2_fp8_word((&(") :]
    combine = loop.index(f"csa2_fp8_combine<{full['block_n'] // 64}>")
    assert combine < loop.index("csa2_relu_wsum_store<")
    assert ".arrive();" not in loop[:combine], "the stage is released before the combine reads its scale words"
    assert loop[:combine].count("tl::warpgroup_wait<") == 1
    log = ptxas_log(src, tmp_path, SM90.nvcc_arch)
    assert parse_resource_usage(log)[1] == 0 and "C7512" not in log


def test_fp8_rs_search_space():
    """fp8_rs: one consumer warpgroup, fused epilogue, block_n <= 128, Hopper only (space and kernel builder);
    {"dequant": "fp8_rs"} alone is a valid config (block_n capped); not a default."""
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    for tile in (ix.INDEXER_TOPK, ix.REINDEX_TOPK):
        space = tile.search_space(SM90)
        cfg = tile.with_defaults(SM90, {"dequant": "fp8_rs", "threads": 128, "epilogue": "fused", "min_ctas": 2})
        assert cfg["block_n"] <= ix.FP8_MAX_BLOCK_N and space.violations(cfg, shape, SM90) == []
        assert any("fp8_rs" in r for r in space.violations({**cfg, "block_n": 256}, shape, SM90))
        assert any("fp8_rs" in r or "epilogue" in r for r in space.violations({**cfg, "epilogue": "hoisted"}, shape, SM90))
        assert tile.default_config(SM90)["dequant"] != "fp8_rs"
    cfg = ix.INDEXER_TOPK.with_defaults(SM90, {"dequant": "fp8_rs"})
    assert cfg["block_n"] == 128 and cfg["epilogue"] == "fused"
    assert ix.INDEXER_TOPK.search_space(SM90).violations(cfg, shape, SM90) == []
    assert any("Hopper" in r for r in ix.INDEXER_TOPK.search_space(get_arch("sm80")).violations(cfg, shape, get_arch("sm80")))
    with pytest.raises(ValueError, match="fp8_rs"):
        ix_score_kernel.build_score_kernel(SM90.nvcc_arch, 256, 128, 1, 16, "fp8_rs", False, 8, 2, "fused")
    with pytest.raises(ValueError, match="sm_90a"):
        ix_score_kernel.build_score_kernel("sm_80", 128, 128, 1, 16, "fp8_rs", False, 8, 2, "fused")


FP8_RS_OPTIONS = {
    "bn128_mc2_st1": {"block_n": 128, "min_ctas": 2, "stages": 1},
    "bn128_mc2_st2": {"block_n": 128, "min_ctas": 2, "stages": 2},
    "bn64_mc3_st3": {"block_n": 64, "min_ctas": 3, "stages": 3},
}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [ix.INDEXER_TOPK, ix.REINDEX_TOPK], ids=lambda t: t.name)
@pytest.mark.parametrize("option", list(FP8_RS_OPTIONS), ids=str)
def test_fp8_rs_matches_reference(tile, option):
    """fp8_rs against the reference (scores rel L2 1e-5, top-k sets by the tie rule, two runs bitwise equal), at the
    decode shape and odd ones: the FP8 group sums are exact only if Hopper's FP8 accumulation keeps 13 bits."""
    arch = get_arch("sm90")
    cfg = tile.with_defaults(arch, {"dequant": "fp8_rs", "threads": 128, "epilogue": "fused", **FP8_RS_OPTIONS[option]})
    for shape in [tile.shape("decode_b64_n32k"), _odd(3, 2, 1000), _odd(2, 1, 77), _odd(1, 3, 4099)]:
        ev = evaluate(tile, shape, cfg, arch, seed=11, time_it=False)
        assert ev.outcome == OK, f"{option} {shape.name}: {ev.message}"


# epilogue=fused (session 7, written without device time): hoisted plus the ReLU-weighted head sum as one FFMA chain a
# row, the quad sum as a reduce-scatter and each quad lane storing its own rows, by hand on the wgmma accumulator.
# (name: (config over the indexer's Hopper default, gather, m-tiles))
FUSED_BUILDS = {
    "default": ({}, False, 4),
    "bn128": ({"block_n": 128}, False, 2),
    "bn64_mc4_st4": ({"block_n": 64, "min_ctas": 4, "stages": 4}, False, 1),
    "fma_rs": ({"dequant": "fma_rs"}, False, 4),
    "gather_bn256": ({"dequant": "prmt_rs", "threads": 128, "block_n": 256, "stages": 1, "tiles_per_cta": 16}, True, 4),
}


def _ptxas(src: str, tmp_path) -> tuple[int, int]:
    """(registers, spill bytes) of the kernel source for sm_90a (:func:`tiles.core.ptxas.resource_usage`)."""
    return resource_usage(src, tmp_path)


@pytest.mark.parametrize("name", list(FUSED_BUILDS))
@pytest.mark.slow
def test_fused_epilogue_replaces_the_head_sum_and_store(name, tmp_path):
    """epilogue=fused: the tile loop hands the accumulator to csa2_relu_wsum_store<m-tiles> (no TileLang head sum, no
    4-lane AllReduce, no row fragment, no w_half), w / 2 sits in a plain local array loaded once per CTA, no proxy
    fence enters the loop (the contiguous variant passes no shared pointer), and ptxas neither spills nor serialises."""
    import shutil

    cfg, gather, mtiles = FUSED_BUILDS[name]
    tile = ix.REINDEX_TOPK if gather else ix.INDEXER_TOPK
    full = {**tile.default_config(SM90), **cfg, "epilogue": "fused"}
    assert tile.search_space(SM90).violations(full, tile.shapes()[0], SM90) == []
    src = ix_launch.build_score(SM90, full, gather, 8, *DECODE_GRID).get_kernel_source()
    loop = _tile_loop(src)
    assert f"csa2_relu_wsum_store<{mtiles}>((&(acc[0])), (&(w_loc[0])), out_ptr, " in loop
    assert "AllReduce" not in src and "float row[" not in src and "float w_half[" not in src and "float w_loc[8];" in src
    assert "weights" not in loop and "out_cta" not in src and "csa2_pin_ptr(" in src and "csa2_load_w_half(" in src
    if not gather:
        assert "fence_proxy_async" not in loop and "pos_s" not in src
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: registers and spills not checked")
    regs, spills = _ptxas(src, tmp_path)
    assert spills == 0, (regs, spills)


def test_fused_epilogue_is_a_one_warpgroup_rs_option():
    """In both score tiles' spaces: fused with the RS dequants on one consumer warpgroup; refused (with the reason) for
    the shared-tile dequants and for two warpgroups, by the kernel builder too. The indexer's Hopper default uses it."""
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    for tile in (ix.INDEXER_TOPK, ix.REINDEX_TOPK):
        space = tile.search_space(SM90)
        base = {**tile.default_config(SM90), "block_n": 256, "threads": 128, "stages": 1}
        for dequant in ix.REGISTER_A_DEQUANTS:
            fits = {"block_n": ix.FP8_MAX_BLOCK_N} if dequant == "fp8_rs" else {}
            assert space.violations({**base, "dequant": dequant, "min_ctas": 2, "epilogue": "fused", **fits}, shape, SM90) == []
        why = space.violations({**base, "dequant": "prmt", "epilogue": "fused"}, shape, SM90)
        assert any("epilogue=fused needs dequant" in r for r in why)
        why = space.violations({**base, **TWO_WARPGROUPS, "dequant": "prmt_rs", "min_ctas": 2, "epilogue": "fused"}, shape, SM90)
        assert any("one consumer warpgroup" in r for r in why)
    assert ix.INDEXER_TOPK.default_config(SM90)["epilogue"] == "fused"  # Hopper's default since session 8
    assert ix.REINDEX_TOPK.default_config(SM90)["epilogue"] != "fused"  # not measured there
    with pytest.raises(ValueError, match="fused"):
        ix_score_kernel.build_score_kernel(SM90.nvcc_arch, 128, 256, 2, 16, "prmt_rs", False, 8, 2, "fused")
    with pytest.raises(ValueError, match="fused"):
        ix_score_kernel.build_score_kernel(SM90.nvcc_arch, 256, 128, 1, 16, "prmt", False, 8, 2, "fused")


def _fused_epilogue_model(acc_tile, w, mtiles: int):
    """csa2_relu_wsum_store per thread on a [64 m, 32] accumulator tile: the wgmma D fragment (PTX m64nNk16: element a of
    m-tile m is row 64m + 16 warp + 8 ((a >> 1) & 1) + lane / 4, head 8 (a >> 2) + 2 (lane % 4) + (a & 1)), the FFMA
    chain per row, the two reduce-scatter steps and the rows each lane stores. Returns {row: value}."""
    import numpy as np

    f32 = np.float32

    def fma(a, b, c):  # exact product, one rounding (binary64 holds a * b exactly; the sum rounds at most twice)
        return f32(float(a) * float(b) + float(c))

    v = {}  # (thread, r) -> partial row sum over the thread's 8 heads
    for tid in range(128):
        lane, warp, q = tid % 32, tid // 32, tid % 4
        acc = [0.0] * (16 * mtiles)
        for m in range(mtiles):
            for a in range(16):
                acc[16 * m + a] = acc_tile[64 * m + 16 * warp + 8 * ((a >> 1) & 1) + lane // 4, 8 * (a >> 2) + 2 * q + (a & 1)]
        wl = [f32(w[8 * k + 2 * q + j] * f32(0.5)) for k in range(4) for j in range(2)]
        for r in range(2 * mtiles):
            base, s = (r >> 1) * 16 + (r & 1) * 2, f32(0)
            for rv in range(8):
                x = f32(acc[base + (rv & 3) * 4 + (rv >> 2)])
                t, wh = f32(x + abs(x)), wl[(rv & 3) * 2 + (rv >> 2)]
                s = f32(t * wh) if rv == 0 else fma(t, wh, s)
            v[tid, r] = s
    u, stored = {}, {}
    for tid in range(128):  # step 1: keep v[p + M b] + the partner's (lane ^ 2) copy of it
        b = (tid >> 1) & 1
        for p in range(mtiles):
            u[tid, p] = f32(v[tid, p + mtiles * b] + v[tid ^ 2, p + mtiles * b])
    for tid in range(128):
        lane, warp, b, c = tid % 32, tid // 32, (tid >> 1) & 1, tid & 1
        if mtiles >= 2:
            for p in range(mtiles // 2):
                vi = p + c * (mtiles // 2) + b * mtiles
                z = f32(u[tid, p + c * (mtiles // 2)] + u[tid ^ 1, p + c * (mtiles // 2)])
                row = (vi >> 1) * 64 + warp * 16 + (vi & 1) * 8 + lane // 4
                assert row not in stored
                stored[row] = z
        elif not c:
            row = warp * 16 + b * 8 + lane // 4
            assert row not in stored
            stored[row] = f32(u[tid, 0] + u[tid ^ 1, 0])
    return stored


@pytest.mark.parametrize("mtiles", [1, 2, 4])
def test_fused_epilogue_model_stores_every_row_once_with_its_score(mtiles):
    """The fused epilogue's index algebra (a Python model of csa2_relu_wsum_store on the PTX accumulator layout): every
    row of the tile is stored by exactly one lane, with sum_h max(acc, 0) w_h of that row (fp32, to rounding); the
    model fails with the row halves (8 ((a >> 1) & 1)) or the reduce-scatter lanes swapped."""
    import numpy as np

    gen = np.random.default_rng(7 + mtiles)
    acc = gen.standard_normal((64 * mtiles, 32)).astype(np.float32)
    w = gen.standard_normal(32).astype(np.float32)
    got = _fused_epilogue_model(acc, w, mtiles)
    assert sorted(got) == list(range(64 * mtiles))
    want = (np.maximum(acc.astype(np.float64), 0) * w.astype(np.float64)).sum(axis=1)
    err = np.array([got[i] for i in range(64 * mtiles)], dtype=np.float64) - want
    assert np.linalg.norm(err) <= 1e-6 * np.linalg.norm(want)


_FUSED_EPILOGUE_STATEMENTS = {  # what _fused_epilogue_model mirrors of score_kernel._FUSED_EPI_CUDA, by helper
    "csa2_load_w_half": (
        "const int q = threadIdx.x & 3;",
        "const float2 p = *(const float2*)(wrow + 8 * k + 2 * q); w[2 * k] = p.x * 0.5f; w[2 * k + 1] = p.y * 0.5f;",
    ),
    "csa2_relu_wsum_store": (
        "const int l = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;",
        "for (int r = 0; r < 2 * M; ++r) { const int base = (r >> 1) * 16 + (r & 1) * 2; float s = 0.0f;",
        "const float x = acc[base + (rv & 3) * 4 + (rv >> 2)];",
        "const float t = x + fabsf(x);",
        "const float wh = w[(rv & 3) * 2 + (rv >> 2)];",
        "s = rv == 0 ? t * wh : fmaf(t, wh, s);",
        "const bool b = (l >> 1) & 1, c = l & 1;",
        "const float send = b ? v[p] : v[p + M], keep = b ? v[p + M] : v[p];",
        "u[p] = keep + __shfl_xor_sync(0xffffffffu, send, 2);",
        "const float send = c ? u[p] : u[p + M / 2], keep = c ? u[p + M / 2] : u[p];",
        "const float z = keep + __shfl_xor_sync(0xffffffffu, send, 1);",
        "const int vi = p + c * (M / 2) + b * M;",
        "const int row = (vi >> 1) * 64 + warp * 16 + (vi & 1) * 8 + (l >> 2);",
        "const float z = u[0] + __shfl_xor_sync(0xffffffffu, u[0], 1);",
        "const int row = warp * 16 + b * 8 + (l >> 2);",
        "if (!c && off + row < n_left)",
    ),
}


@pytest.mark.parametrize("helper", list(_FUSED_EPILOGUE_STATEMENTS))
def test_fused_epilogue_model_follows_the_cuda_source(helper):
    _assert_follows(ix_score_kernel._FUSED_EPI_CUDA, helper, _FUSED_EPILOGUE_STATEMENTS[helper])


@pytest.mark.slow
def test_prmt_compiles_with_two_ctas_per_sm():
    """prmt at two CTAs per SM (the Hopper default from profile_indexer_prmt_two_pass.json until prmt_rs replaced it,
    profile_compressor_multi_cta_indexer_prmt_rs.json); the reindex tile's default (profile_attn_decode_reindex_prmt.json:
    its prmt_rs ran slower)."""
    cfg = ix.INDEXER_TOPK.with_defaults(SM90, {**TWO_WARPGROUPS, "dequant": "prmt", "min_ctas": 2, "stages": 3})
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    assert ix.INDEXER_TOPK.search_space(SM90).violations(cfg, shape, SM90) == []
    ix.INDEXER_TOPK.build(shape, cfg, SM90)
    src = ix_launch.build_score(SM90, cfg, False, 8, *DECODE_GRID).get_kernel_source()
    assert "csa2_fp4_group_bf16" in src and "__launch_bounds__(512, 2)" in src
    default = ix.INDEXER_TOPK.default_config(SM90)
    assert (default["dequant"], default["min_ctas"], default["select_algo"]) == ("prmt_rs", 2, "two_pass")
    reindex = ix.REINDEX_TOPK.default_config(SM90)
    assert (reindex["dequant"], reindex["min_ctas"], reindex["select_algo"]) == ("prmt", 2, "two_pass")
    assert ix.INDEXER_TOPK.default_config(get_arch("sm80"))["dequant"] != "prmt"


def test_min_ctas_counts_shared_memory_per_sm():
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    space = ix.INDEXER_TOPK.search_space(SM90)
    cfg = ix.INDEXER_TOPK.with_defaults(SM90, {**TWO_WARPGROUPS, "dequant": "prmt", "stages": 4})
    assert space.violations({**cfg, "min_ctas": 2}, shape, SM90) == []
    assert any("per SM" in r for r in space.violations({**cfg, "min_ctas": 3}, shape, SM90))


def test_fragment_paths_need_one_mtile_per_warpgroup():
    """block_n 256 on two warpgroups gave each warpgroup's A fragment rows {wg*64 + i*128} but its accumulator rows
    {wg*128 + i*64} (TileLang's layouts; rel err 0.92 on the H200): pruned, one warpgroup or block_n 128 kept."""
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    space = ix.INDEXER_TOPK.search_space(SM90)
    bad = ix.INDEXER_TOPK.with_defaults(
        SM90, {**TWO_WARPGROUPS, "dequant": "fragment_bits", "stages": 4, "block_n": 256, "tiles_per_cta": 4}
    )
    assert any("one 64-row wgmma tile" in r for r in space.violations(bad, shape, SM90))
    assert any("one 64-row wgmma tile" in r for r in space.violations({**bad, "dequant": "registers"}, shape, SM90))
    assert space.violations({**bad, "block_n": 128}, shape, SM90) == []
    assert space.violations({**bad, "threads": 128}, shape, SM90) == []
    assert space.violations({**bad, "dequant": "bits", "stages": 2}, shape, SM90) == []  # shared-tile A: no fragment


def test_bits_dequant_formula_is_exact():
    """Every code x every scale byte the formula claims (2..252) decodes as model.formats does."""
    from model import formats

    codes = torch.arange(16, dtype=torch.int32).repeat(251)  # [16 * 251]
    sbyte = torch.arange(2, 253, dtype=torch.int32).repeat_interleave(16)
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(-1, 1)  # one byte per row: codes 2r, 2r+1
    want = formats.fp4_dequantize(packed, sbyte[0::2].to(torch.uint8).view(-1, 1), 2, "e8m0").view(-1)
    got = _bits_dequant(codes, sbyte)
    assert torch.equal(got.view(torch.int32) & ~0x80000000, want.view(torch.int32) & ~0x80000000)  # +-0 aside
    assert torch.equal(got, want)


def test_hopper_default_uses_the_new_score_path():
    cfg = ix.INDEXER_TOPK.default_config(SM90)
    assert cfg["dequant"] == "prmt_rs" and cfg["tiles_per_cta"] == "auto"
    assert ix.REINDEX_TOPK.default_config(SM90)["dequant"] == "prmt"
    assert ix.INDEXER_TOPK.default_config(get_arch("sm80"))["dequant"] == "shared"


def test_auto_tiles_per_cta_fills_the_sms():
    """tiles_per_cta="auto": 16 tiles where the rows fill the GPU (the kernels the fixed default ran), fewer for few rows
    (one sequence over 128K entries: 4 tiles, 128 CTAs on the H200's 132 SMs), 1 for short caches; a number is kept."""
    resolve = ix.resolve_tiles_per_cta
    assert resolve("auto", 64, 131072, 256, SM90) == 16  # decode B=64: 2048 CTAs
    assert resolve("auto", 4096, 4096, 256, SM90) == 16  # prefill 4K
    assert resolve("auto", 1, 131072, 256, SM90) == 4  # decode B=1: 128 CTAs (16 tiles: 32)
    assert resolve("auto", 8, 131072, 256, SM90) == 16  # 256 CTAs
    assert resolve("auto", 1, 8192, 256, SM90) == 1
    assert resolve(16, 1, 8192, 256, SM90) == 16
    with pytest.raises(ValueError, match="resolved per grid"):
        ix_launch.build_score(SM90, ix.INDEXER_TOPK.default_config(SM90), False, 8)
    # the B=64 decode kernel is the one 16 tiles built before
    full = ix.INDEXER_TOPK.default_config(SM90)
    assert ix_launch.build_score(SM90, full, False, 8, *DECODE_GRID) is ix_launch.build_score(SM90, {**full, "tiles_per_cta": 16}, False, 8)


def test_smem_constraint_counts_the_pipelined_dequant_tile():
    """block_n 256 x 3 stages of the lut variant needed 253 KiB on the H200 and failed to launch: it must be pruned."""
    shape = ix.INDEXER_TOPK.shapes()[0]
    big = {**ix.INDEXER_TOPK.default_config(SM90), "block_n": 256, "stages": 3, "dequant": "lut", "tiles_per_cta": 1}
    assert any("shared memory" in v for v in ix.INDEXER_TOPK.search_space(SM90).violations(big, shape, SM90))
    assert ix.INDEXER_TOPK.search_space(SM90).violations(ix.INDEXER_TOPK.default_config(SM90), shape, SM90) == []


def test_constraints_prune():
    space = ix.INDEXER_TOPK.search_space(SM90)
    shape = ix.INDEXER_TOPK.shapes()[0]
    bad = {**ix.INDEXER_TOPK.default_config(SM90), "block_n": 64, "threads": 256}
    assert any("warpgroups" in r for r in space.violations(bad, shape, SM90))
    assert space.violations({**bad, "threads": 128}, shape, SM90) == []
    assert any("not one of" in r for r in space.violations({"radix_bits": 9}, shape, SM90))


def _indexer_args(B=2, S=1, N=100, device="cpu"):
    q = torch.zeros(B, S, 32, 128, dtype=torch.bfloat16, device=device)
    w = torch.zeros(B, S, 32, device=device)
    kp = torch.zeros(B, N, 64, dtype=torch.uint8, device=device)
    ks = torch.full((B, N, 4), 127, dtype=torch.uint8, device=device)
    nv = torch.full((B, S), N, dtype=torch.int32, device=device)
    return q, w, kp, ks, nv


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (a[0][..., :64], *a[1:]), "q must have shape"),
        (lambda a: (a[0].half(), *a[1:]), "q must be"),
        (lambda a: (a[0], a[1].double(), *a[2:]), "weights must be"),
        (lambda a: (*a[:2], a[2][..., :32], *a[3:]), "k_packed must have shape"),
        (lambda a: (*a[:3], a[3][..., :2], a[4]), "k_scales must have shape"),
        (lambda a: (*a[:4], a[4].float()), "n_visible must be"),
        (lambda a: a, "CUDA GPU"),
    ],
    ids=["q_dim", "q_dtype", "w_dtype", "k_packed", "k_scales", "n_visible", "cpu"],
)
def test_indexer_topk_rejects(change, message):
    with pytest.raises(TileError, match=message):
        ix.indexer_topk(*change(_indexer_args()), 512)


def test_candidate_pool_and_reindex_reject():
    with pytest.raises(TileError, match="scores must be float32"):
        ix.candidate_pool(torch.zeros(2, 1, 100, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(TileError, match="n_visible must have shape"):
        ix.candidate_pool(torch.zeros(2, 1, 100), torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(TileError, match="pool_blocks must be"):
        ix.reindex_topk(*_indexer_args(), torch.zeros(2, 1, 16, dtype=torch.int64), 8, 512)
    with pytest.raises(TileError, match="topk must be positive"):
        ix.indexer_topk(*_indexer_args(), 0)


def test_topk_set_rule():
    scores = torch.tensor([[[5.0, 1.0, 3.0, 3.0, 2.0, float("-inf")]]])  # the 2nd/3rd best tie at 3.0
    ref = topk_positions(scores, 3)
    assert ref.tolist() == [[[0, 2, 3]]]
    swapped = torch.tensor([[[0, 2, 3]]], dtype=torch.int32)
    assert ix.compare_topk_sets(swapped, ref, scores).ok
    tie_ok = torch.tensor([[[0, 3, 4]]], dtype=torch.int32)  # drops 2 (a tie member) for 4 (score 2.0, not a tie)
    assert not ix.compare_topk_sets(tie_ok, ref, scores).ok
    scores2 = torch.tensor([[[5.0, 3.0, 3.0, 3.0]]])
    ref2 = topk_positions(scores2, 2)  # lower position wins the tie: [0, 1]
    assert ref2.tolist() == [[[0, 1]]]
    assert ix.compare_topk_sets(torch.tensor([[[0, 3]]], dtype=torch.int32), ref2, scores2).ok
    assert not ix.compare_topk_sets(torch.tensor([[[3, 0]]], dtype=torch.int32), ref2, scores2).ok  # not ascending
    assert not ix.compare_topk_sets(torch.tensor([[[0, -1]]], dtype=torch.int32), ref2, scores2).ok  # wrong count


def test_random_pool_is_a_valid_pool():
    gen = torch.Generator().manual_seed(0)
    nv = torch.tensor([[0, 13, 1000]], dtype=torch.int32)
    pool = ix_reference.random_pool(nv, 1000, 64, 8, gen)
    assert pool.shape == (1, 3, 64)
    assert (pool[0, 0] == -1).all()
    assert set(pool[0, 1].tolist()) == {0, 1, -1}
    row = pool[0, 2][pool[0, 2] >= 0]
    assert row.numel() == 64 and bool((row[1:] > row[:-1]).all()) and 124 in row.tolist()


# ---------------------------------------------------------------------------------- GPU


def _gpu_shapes(tile):
    real = [s for s in tile.shapes() if s.name in ("decode_b64_n32k", "decode_b1_n128k", "prefill_s4k")]
    return real + [_odd(3, 2, 1000), _odd(2, 1, 77)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ix.TILES, ids=lambda t: t.name)
def test_tile_matches_reference(tile):
    arch = get_arch("sm90")
    for shape in _gpu_shapes(tile):
        ev = evaluate(tile, shape, tile.default_config(arch), arch, seed=1, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"


# dequant=prmt_rs (prmt lookups into the wgmma A fragment, K and q in the _rs_dim order), at the default's occupancy and
# at the smaller-CTA shapes the tuner liked for prmt; written without device time (session 5), compiled for sm_90a.
PRMT_RS_OPTIONS = {  # per_tile named: the epilogue these configs were written (and measured) with
    "mc2": {"dequant": "prmt_rs", "min_ctas": 2, "epilogue": "per_tile"},
    "mc2_st4": {"dequant": "prmt_rs", "min_ctas": 2, "stages": 4, "epilogue": "per_tile"},
    "t128_bn64_mc4": {"dequant": "prmt_rs", "threads": 128, "block_n": 64, "min_ctas": 4, "stages": 4, "epilogue": "per_tile"},
    "t128_bn64_mc3": {
        "dequant": "prmt_rs",
        "threads": 128,
        "block_n": 64,
        "min_ctas": 3,
        "stages": 3,
        "tiles_per_cta": 4,
        "epilogue": "per_tile",
    },
    "t128_bn128_mc3": {"dequant": "prmt_rs", "threads": 128, "block_n": 128, "min_ctas": 3, "stages": 4, "epilogue": "per_tile"},
    "mc0": {"dequant": "prmt_rs", "min_ctas": 0, "epilogue": "per_tile"},
}
# dequant=fma_rs (prmt_rs's fragment built by IMAD bit placement + two bf16 multiplies), the same configs; written without
# device time (session 5), compiled for sm_90a.
FMA_RS_OPTIONS = {name: {**cfg, "dequant": "fma_rs"} for name, cfg in PRMT_RS_OPTIONS.items()}


# Every score-path option, the pre-sm90-default path included: scores by relative L2, top-k
# sets exact up to the tie rule (evaluate also requires two runs bitwise equal). The options were written over the
# two-warpgroup layout (the Reindex default's, the indexer's until session 7) and keep it; "default" is each tile's own.
_SCORE_OPTIONS = {
    "old_default": {**ix_space.SCORE_DEFAULT},
    "bits_t1": {"dequant": "bits", "tiles_per_cta": 1},
    "bits_t4_1wg": {"dequant": "bits", "tiles_per_cta": 4, "threads": 128, "stages": 1},
    "bits_t16": {"dequant": "bits", "tiles_per_cta": 16},
    "bits_bn64": {"dequant": "bits", "block_n": 64, "threads": 128, "stages": 3},
    "lut": {"dequant": "lut", "threads": 128, "stages": 1},
    "registers": {"dequant": "registers"},
    "fragment_bits_st4": {"dequant": "fragment_bits", "stages": 4},  # written in session 3 after the device time was spent
    "fragment_bits_t128_bn256": {"dequant": "fragment_bits", "threads": 128, "block_n": 256, "stages": 4, "tiles_per_cta": 4},
    "prmt": {"dequant": "prmt"},
    "prmt_mc2_st3": {"dequant": "prmt", "min_ctas": 2, "stages": 3},
    "prmt_mc3": {"dequant": "prmt", "min_ctas": 3, "threads": 128, "stages": 2, "tiles_per_cta": 4},
    **{f"prmt_rs_{name}": cfg for name, cfg in PRMT_RS_OPTIONS.items()},
    **{f"fma_rs_{name}": cfg for name, cfg in FMA_RS_OPTIONS.items()},
    "prmt_rs_mc2_hoisted": {**PRMT_RS_OPTIONS["mc2"], "epilogue": "hoisted"},
    "fma_rs_mc2_hoisted": {**FMA_RS_OPTIONS["mc2"], "epilogue": "hoisted"},
}
SCORE_OPTIONS = {"default": {}, **{name: {**TWO_WARPGROUPS, **cfg} for name, cfg in _SCORE_OPTIONS.items()}}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [ix.INDEXER_TOPK, ix.REINDEX_TOPK], ids=lambda t: t.name)
@pytest.mark.parametrize("option", list(SCORE_OPTIONS), ids=str)
def test_score_options_match_reference(tile, option):
    arch = get_arch("sm90")
    cfg = tile.with_defaults(arch, SCORE_OPTIONS[option])
    for shape in [tile.shape("decode_b64_n32k"), _odd(3, 2, 1000), _odd(2, 1, 77)]:
        ev = evaluate(tile, shape, cfg, arch, seed=3, time_it=False)
        assert ev.outcome == OK, f"{option} {shape.name}: {ev.message}"


TWO_PASS_CASES = [
    # (tile, shapes): indexer_topk (its default since session 4), the candidate pool (k = 2048 block maxima on coarse,
    # heavily tied scores, the newest block forced to +inf; compared bit-exactly), Reindex (slots mapped back to
    # cache positions through a position map; unused pool blocks and invisible slots score -inf, never chosen)
    (ix.INDEXER_TOPK, ["decode_b64_n32k", "decode_b1_n128k", "prefill_s4k", _odd(3, 2, 1000), _odd(2, 1, 77)]),
    (ix.CANDIDATE_POOL, ["decode_b64_n32k", "decode_b1_n128k", _odd(2, 3, 1001), _odd(1, 1, 5)]),
    (ix.REINDEX_TOPK, ["decode_b64_n32k", "decode_b1_n128k", _odd(3, 2, 4001), _odd(2, 1, 77)]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile,shapes", TWO_PASS_CASES, ids=[t.name for t, _ in TWO_PASS_CASES])
def test_two_pass_select_matches_reference(tile, shapes):
    """select_algo=two_pass (tiles.indexer.radix_select) in each tile that selects: the reference's result by its rule."""
    arch = get_arch("sm90")
    cfg = {**tile.default_config(arch), "select_algo": "two_pass"}
    for spec in shapes:
        shape = tile.shape(spec) if isinstance(spec, str) else spec
        ev = evaluate(tile, shape, cfg, arch, seed=5, time_it=False)
        assert ev.outcome == OK, f"two_pass {tile.name} {shape.name}: {ev.message}"


def test_min_ctas_register_cap_is_a_constraint():
    """min_ctas 3 at 256 consumer threads leaves ptxas 40 registers: it cannot assemble the kernel, so the space prunes it."""
    arch = get_arch("sm90")
    tile = ix.INDEXER_TOPK
    shape = tile.shape("decode_b64_n128k")
    bad = tile.with_defaults(arch, {**TWO_WARPGROUPS, "dequant": "prmt", "min_ctas": 3})
    assert any("registers per thread" in r for r in tile.search_space(arch).violations(bad, shape, arch))
    ok = {**bad, "threads": 128, "tiles_per_cta": 4}
    assert not any("registers per thread" in r for r in tile.search_space(arch).violations(ok, shape, arch))


def test_two_pass_select_is_in_the_search_space():
    arch = get_arch("sm90")
    tile = ix.INDEXER_TOPK
    cfg = {**tile.default_config(arch), "select_algo": "two_pass"}
    assert tile.search_space(arch).violations(cfg, tile.shape("decode_b64_n128k"), arch) == []
    assert tile.build(tile.shape("decode_b64_n128k"), cfg, arch)[0]["select_algo"] == "two_pass"


def test_radix_knobs_default_to_radix_selects_defaults():
    """The indexer's radix_* knobs map onto tiles.indexer.radix_select's config; their defaults build the kernels the two-pass
    select built before the knobs existed (the same objects), and they are refused under the multipass select."""
    from tiles.indexer import radix_select

    arch, tile = SM90, ix.INDEXER_TOPK
    cfg = tile.default_config(arch)
    assert ix.radix_config(cfg) == {k: radix_select.DEFAULT_CONFIG[k] for k in ("threads", "stage", "parts")}
    assert ix.radix_config({**cfg, "radix_stage": "shared", "radix_threads": 512})["stage"] == "shared"
    old = ix_launch.build_two_pass(arch, 64, 131072, 512)
    assert ix_launch.build_two_pass(arch, 64, 131072, 512, ix.radix_config(cfg)) == old
    space, shape = tile.search_space(arch), tile.shape("decode_b1_n128k")
    staged = {**cfg, "radix_stage": "shared", "radix_threads": 512, "radix_parts": 16}
    assert space.violations(staged, shape, arch) == []
    multipass = {**staged, "select_algo": "multipass"}
    assert any(
        "radix_parts, radix_stage, radix_threads apply to select_algo=two_pass only" in r for r in space.violations(multipass, shape, arch)
    )
    assert space.violations({**cfg, "select_algo": "multipass"}, shape, arch) == []
    # a staged part (64 KiB of scores) does not fit the 99 KiB of sm86/89/120
    sm89 = get_arch("sm89")
    staged89 = {**tile.default_config(sm89), "select_algo": "two_pass", "radix_stage": "shared"}
    assert any("radix_smem" in r for r in tile.search_space(sm89).violations(staged89, shape, sm89))
    assert not any("radix_smem" in r for r in tile.search_space(sm89).violations({**staged89, "radix_stage": "global"}, shape, sm89))
    # the staged 512-thread select is seeded as a candidate (the sampler rarely proposes it with the default score kernel)
    from tuning.space import seed_configs

    seeded = [c for c, source in seed_configs(tile, shape, arch) if source.startswith("candidate")]
    assert {**cfg, "radix_stage": "shared", "radix_threads": 512} in seeded


@pytest.mark.slow
def test_radix_knobs_reach_the_select_kernels():
    """A staged 512-thread select in 16 parts compiles for one 128K row, and its kernels differ from the default's."""
    arch, tile = SM90, ix.INDEXER_TOPK
    shape = tile.shape("decode_b1_n128k")
    cfg = {**tile.default_config(arch), "radix_stage": "shared", "radix_threads": 512, "radix_parts": 16}
    staged, default = tile.kernel_sources(shape, cfg, arch), tile.kernel_sources(shape, tile.default_config(arch), arch)
    assert staged["score"] == default["score"]
    assert "select_row_staged" in staged["select"] and "select_row_staged" not in default["select"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "radix",
    [
        {"radix_stage": "shared", "radix_threads": 512},
        {"radix_parts": 32},
        {"radix_stage": "shared", "radix_threads": 1024, "radix_parts": 16},
    ],
    ids=["staged_512", "parts_32", "staged_1024_parts_16"],
)
def test_radix_knobs_match_reference(radix):
    """The two-pass select's knobs at one long row (where they matter) and at decode B=64: the reference's top-k sets."""
    arch, tile = get_arch("sm90"), ix.INDEXER_TOPK
    for name in ("decode_b1_n128k", "decode_b64_n32k"):
        ev = evaluate(tile, tile.shape(name), {**tile.default_config(arch), **radix}, arch, seed=9, time_it=False)
        assert ev.outcome == OK, f"{radix} {name}: {ev.message}"


_TORCH_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    """torch.empty whose memory is poisoned (tiles.core.contract.poisoned's rule for the buffers a public function
    allocates itself): NaN for floats, the most negative value for int32 (neither a position nor the -1 fill), all bits
    set for bytes."""
    t = _TORCH_EMPTY(*args, **kwargs)
    if t.dtype == torch.float32:
        t.fill_(float("nan"))
    elif t.dtype == torch.int32:
        t.fill_(torch.iinfo(torch.int32).min)
    elif t.dtype == torch.uint8:
        t.fill_(0xFF)
    return t


def _call_twice(call):
    """``call()`` of a public function (it allocates its outputs) twice, every torch.empty inside poisoned: the first
    result (a tensor or a tuple of them), after requiring the second to hold the same bits. An element never written
    stays poisoned, which the reference comparison refuses; a race shows as two different results."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", _poisoned_empty)
        first, second = call(), call()
    for a, b in zip(*((r,) if isinstance(r, torch.Tensor) else r for r in (first, second)), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "two calls differ"
    return first


def _indexer_call(inputs, config: dict | None, label: str, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """ix.indexer_topk (top 512, with the scores) with ``config``, called twice on poisoned outputs (:func:`_call_twice`)
    and, with ``check``, compared with the torch reference (scores by relative L2, top-k sets by the tie rule): (top-k,
    scores)."""
    args = (inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"])
    out, scores = _call_twice(lambda: ix.indexer_topk(*args, 512, return_scores=True, config=config))
    if check:
        cmp = ix.INDEXER_TOPK.compare({"topk": out, "scores": scores}, ix.INDEXER_TOPK.reference(inputs))
        assert cmp.ok, f"indexer_topk {label}: {cmp}"
    return out, scores


def _reindex_call(inputs, pool, config: dict, label: str, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """ix.reindex_topk (blocks of 8, top 512, with the slots' scores) over ``pool`` with ``config``, as
    :func:`_indexer_call`: (top-k, slot scores)."""
    args = (inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"])
    out, scores = _call_twice(lambda: ix.reindex_topk(*args, pool, 8, 512, config=config, return_scores=True))
    if check:
        ref = ix.REINDEX_TOPK.reference({**inputs, "pool_blocks": pool})
        cmp = ix.REINDEX_TOPK.compare({"topk": out, "pool_scores": scores}, ref)
        assert cmp.ok, f"reindex_topk {label}: {cmp}"
    return out, scores


@pytest.mark.gpu
def test_bits_scores_equal_shared_scores():
    """Both paths feed the same exact bf16 K to the same MMA: the score rows must agree bitwise (and each with the
    reference)."""
    inputs = ix_reference.indexer_inputs(4, 1, 5000, 11, "cuda", causal=False)
    _, a = _indexer_call(inputs, {**ix_space.SCORE_DEFAULT, "dequant": "bits"}, "bits")
    _, b = _indexer_call(inputs, {**ix_space.SCORE_DEFAULT, "dequant": "shared"}, "shared")
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_prmt_scores_equal_bits_scores():
    """dequant=prmt builds the bits path's bf16 patterns by byte permutes: the same K into the same MMA, bitwise (and
    each against the reference)."""
    inputs = ix_reference.indexer_inputs(4, 1, 5000, 13, "cuda", causal=False)
    sm90 = ix_space.SCORE_DEFAULT_SM90
    _, a = _indexer_call(inputs, {**sm90, "dequant": "prmt", "min_ctas": 2}, "prmt")
    _, b = _indexer_call(inputs, {**sm90, "dequant": "bits"}, "bits")
    assert torch.equal(a, b)


RS_OPTIONS = {**{f"prmt_rs-{k}": v for k, v in PRMT_RS_OPTIONS.items()}, **{f"fma_rs-{k}": v for k, v in FMA_RS_OPTIONS.items()}}

# epilogue=hoisted (w / 2 and the output row pointer once per CTA; written without device time, compiled for sm_90a):
# every prmt_rs config above and the fma_rs ones the tuner is likely to try.
HOISTED_OPTIONS = {
    **{f"prmt_rs-{k}": {**v, "epilogue": "hoisted"} for k, v in PRMT_RS_OPTIONS.items()},
    **{f"fma_rs-{k}": {**FMA_RS_OPTIONS[k], "epilogue": "hoisted"} for k in ("mc2", "mc2_st4", "t128_bn64_mc4")},
}
# Checked against the reference together: each RS dequant, and each with the hoisted epilogue.
RS_REFERENCE_OPTIONS = {**RS_OPTIONS, **{f"hoisted-{k}": v for k, v in HOISTED_OPTIONS.items()}}


def _assert_indexer_matches_reference(option_config, label: str) -> None:
    """indexer_topk with ``option_config`` over the Hopper default, at the real decode shape and odd ones (partial tiles,
    n_visible < top-k, empty rows), checked by evaluate against the reference (poisoned outputs, two runs bitwise equal)."""
    arch = get_arch("sm90")
    cfg = {**ix.INDEXER_TOPK.default_config(arch), **option_config}
    for shape in [ix.INDEXER_TOPK.shape("decode_b64_n128k"), _odd(3, 2, 1000), _odd(2, 1, 77), _odd(1, 3, 4099)]:
        ev = evaluate(ix.INDEXER_TOPK, shape, cfg, arch, seed=17, time_it=False)
        assert ev.outcome == OK, f"{label} {shape.name}: {ev.message}"


@pytest.mark.gpu
@pytest.mark.parametrize("option", list(RS_REFERENCE_OPTIONS), ids=str)
def test_rs_matches_reference(option):
    """dequant=prmt_rs / fma_rs (with either epilogue) on indexer_topk at the real decode shape and odd ones (partial
    tiles, n_visible < top-k, empty rows): scores by relative L2 and top-k sets against the reference (evaluate:
    poisoned outputs, two runs bitwise equal). Their scores are not bitwise the prmt kernel's: the wgmma sums the
    permuted dims in another order."""
    _assert_indexer_matches_reference(RS_REFERENCE_OPTIONS[option], option)


@pytest.mark.gpu
@pytest.mark.parametrize("dequant, against", [("prmt_rs", "prmt"), ("fma_rs", "prmt_rs")])
def test_rs_scores_close_to_the_shared_memory_path(dequant, against):
    """Same K values and products as ``against`` (prmt_rs and fma_rs build the same A operands, bit for bit, CPU
    tests), other summation order inside the MMA: equal to ~1 ulp of the row scale (and each against the reference)."""
    inputs = ix_reference.indexer_inputs(4, 1, 5000, 13, "cuda", causal=False)
    sm90 = ix_space.SCORE_DEFAULT_SM90
    _, a = _indexer_call(inputs, {**sm90, "dequant": dequant, "min_ctas": 2}, dequant)
    _, b = _indexer_call(inputs, {**sm90, "dequant": against, "min_ctas": 2}, against)
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    fin = torch.isfinite(b)
    assert float((a[fin] - b[fin]).norm() / b[fin].norm().clamp(min=1e-30)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dequant", ["fma_rs", "prmt_rs"])
def test_rs_wide_scale_bytes_match_reference(dequant):
    """Scale bytes 96..160 (K up to 6 x 2^33): fma_rs's second bf16 multiply (bytes > 128), the subnormal code-1 input of
    its first one, and prmt_rs on the same data, against the reference scores and top-k sets."""
    inputs = ix_reference.indexer_inputs(4, 2, 3000, 19, "cuda", causal=False)
    gen = torch.Generator(device="cuda").manual_seed(23)
    inputs["k_scales"] = torch.randint(96, 161, inputs["k_scales"].shape, generator=gen, device="cuda").to(torch.uint8)
    _indexer_call(inputs, {**ix_space.SCORE_DEFAULT_SM90, "dequant": dequant, "min_ctas": 2}, dequant)


@pytest.mark.gpu
@pytest.mark.parametrize("option", list(HOISTED_OPTIONS), ids=str)
def test_hoisted_epilogue_scores_bitwise_equal_per_tile(option):
    """Code motion only: the scores (and so the top-k) are bit for bit those of the same config with
    epilogue=per_tile, on indexer_topk (decode B=64 x 128K, partial last tiles, rows with n_visible 300 and 0) and on
    reindex_topk's gathered variant (unused pool blocks, invisible slots); and against the reference."""
    per_tile = {**HOISTED_OPTIONS[option], "epilogue": "per_tile"}
    for B, S, N in [(64, 1, 131072), (3, 2, 1000), (2, 1, 77)]:
        label = f"{option} B={B} S={S} N={N}"
        inputs = ix_reference.indexer_inputs(B, S, N, 29, "cuda", causal=False)
        out_h, sc_h = _indexer_call(inputs, HOISTED_OPTIONS[option], label)
        out_p, sc_p = _indexer_call(inputs, per_tile, label, check=False)
        assert torch.equal(sc_h.view(torch.int32), sc_p.view(torch.int32)), f"indexer_topk B={B} S={S} N={N}"
        assert torch.equal(out_h, out_p)
        gen = torch.Generator(device="cuda").manual_seed(31)
        pool = ix_reference.random_pool(inputs["n_visible"], N, 2048, 8, gen)  # [B, S, P]
        out_h, sc_h = _reindex_call(inputs, pool, HOISTED_OPTIONS[option], label)
        out_p, sc_p = _reindex_call(inputs, pool, per_tile, label, check=False)
        assert torch.equal(sc_h.view(torch.int32), sc_p.view(torch.int32)), f"reindex_topk B={B} S={S} N={N}"
        assert torch.equal(out_h, out_p)


# epilogue=fused (the indexer's Hopper default since session 8): the default, its 128- and 64-entry
# one-warpgroup layouts (2 and 1 m-tiles: the other reduce-scatter branches) and fma_rs.
FUSED_OPTIONS = {
    "default": {"epilogue": "fused"},
    "bn128": {"epilogue": "fused", "block_n": 128},
    "bn64_mc4_st4": {"epilogue": "fused", "block_n": 64, "min_ctas": 4, "stages": 4},
    "fma_rs": {"epilogue": "fused", "dequant": "fma_rs"},
    "prmt_rs2": {"epilogue": "fused", "dequant": "prmt_rs2"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("option", list(FUSED_OPTIONS), ids=str)
def test_fused_epilogue_matches_reference(option):
    """epilogue=fused on indexer_topk at the real decode shape and odd ones (partial tiles, n_visible < top-k, empty
    rows): scores by relative L2 and top-k sets against the reference (evaluate: poisoned outputs, two runs bitwise
    equal)."""
    _assert_indexer_matches_reference(FUSED_OPTIONS[option], option)


@pytest.mark.gpu
@pytest.mark.parametrize("option", list(FUSED_OPTIONS), ids=str)
def test_fused_epilogue_scores_close_to_hoisted(option):
    """The same products as epilogue=hoisted, each rounded once inside the FFMA instead of once more on its own, and the
    same quad sum (bitwise the AllReduce's): the same -inf pattern, scores within ~1 ulp of the row scale, and top-k
    sets equal up to the tie rule; on indexer_topk and on reindex_topk's gathered variant; and each against the reference."""
    from tiles.core.compare import relative_l2

    fused = {**ix.INDEXER_TOPK.default_config(SM90), **FUSED_OPTIONS[option]}
    hoisted = {**fused, "epilogue": "hoisted"}
    score_keys = ("block_n", "threads", "stages", "tiles_per_cta", "dequant", "min_ctas", "epilogue")  # Reindex's space
    r_fused, r_hoisted = ({k: c[k] for k in score_keys} for c in (fused, hoisted))
    for B, S, N in [(64, 1, 131072), (3, 2, 1000), (2, 1, 77)]:
        label = f"{option} B={B} S={S} N={N}"
        inputs = ix_reference.indexer_inputs(B, S, N, 29, "cuda", causal=False)
        out_f, sc_f = _indexer_call(inputs, fused, f"fused {label}")
        out_h, sc_h = _indexer_call(inputs, hoisted, f"hoisted {label}")
        assert torch.equal(torch.isinf(sc_f), torch.isinf(sc_h)), f"indexer_topk B={B} S={S} N={N}"
        assert relative_l2({"scores": sc_f}, {"scores": sc_h}, 1e-6).ok, f"indexer_topk B={B} S={S} N={N}"
        assert ix.compare_topk_sets(out_f, out_h, sc_h).ok
        gen = torch.Generator(device="cuda").manual_seed(31)
        pool = ix_reference.random_pool(inputs["n_visible"], N, 2048, 8, gen)  # [B, S, P]
        out_f, sc_f = _reindex_call(inputs, pool, r_fused, f"fused {label}")
        out_h, sc_h = _reindex_call(inputs, pool, r_hoisted, f"hoisted {label}")
        assert torch.equal(torch.isinf(sc_f), torch.isinf(sc_h)), f"reindex_topk B={B} S={S} N={N}"
        assert relative_l2({"scores": sc_f}, {"scores": sc_h}, 1e-6).ok, f"reindex_topk B={B} S={S} N={N}"


# dequant=prmt_rs2 against prmt_rs, the same config otherwise: the same A registers (CPU model and emulation above), the
# same q order, wgmma, epilogue and store, so the scores must be bitwise equal.
PRMT_RS2_OPTIONS = {
    "default_fused": {},
    "hoisted": {"epilogue": "hoisted"},
    "bn64_mc4_st4": {"block_n": 64, "min_ctas": 4, "stages": 4},
    "two_warpgroups_hoisted": {**TWO_WARPGROUPS, "epilogue": "hoisted"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("option", list(PRMT_RS2_OPTIONS), ids=str)
def test_prmt_rs2_scores_bitwise_equal_prmt_rs(option):
    """prmt_rs2 and prmt_rs (same layout and epilogue): scores and top-k bitwise equal on indexer_topk (decode B=64 x
    128K, partial tiles, n_visible 300 and 0, and scale bytes 1..252 drawn uniformly: every table row the tile
    reads in range) and on reindex_topk's gathered variant (unused pool blocks: the 0x7F7F7F7F scale fill); and against
    the reference, except on the wide scale bytes (up to 2^125: the sums overflow, to inf or NaN by summation order)."""
    new = {**ix.INDEXER_TOPK.default_config(SM90), **PRMT_RS2_OPTIONS[option], "dequant": "prmt_rs2"}
    old = {**new, "dequant": "prmt_rs"}
    score_keys = ("block_n", "threads", "stages", "tiles_per_cta", "dequant", "min_ctas", "epilogue")
    for B, S, N, wide in [(64, 1, 131072, False), (3, 2, 1000, False), (2, 1, 77, False), (4, 2, 3000, True)]:
        label = f"{option} B={B} S={S} N={N}"
        inputs = ix_reference.indexer_inputs(B, S, N, 41, "cuda", causal=False)
        if wide:
            gen = torch.Generator(device="cuda").manual_seed(43)
            inputs["k_scales"] = torch.randint(1, 253, inputs["k_scales"].shape, generator=gen, device="cuda").to(torch.uint8)
        out_n, sc_n = _indexer_call(inputs, new, label, check=not wide)
        out_o, sc_o = _indexer_call(inputs, old, label, check=False)
        assert torch.equal(sc_n.view(torch.int32), sc_o.view(torch.int32)), f"indexer_topk B={B} S={S} N={N}"
        assert torch.equal(out_n, out_o)
        gen = torch.Generator(device="cuda").manual_seed(47)
        pool = ix_reference.random_pool(inputs["n_visible"], N, 2048, 8, gen)  # [B, S, P]
        r_new, r_old = ({k: c[k] for k in score_keys} for c in (new, old))
        out_n, sc_n = _reindex_call(inputs, pool, r_new, label, check=not wide)
        out_o, sc_o = _reindex_call(inputs, pool, r_old, label, check=False)
        assert torch.equal(sc_n.view(torch.int32), sc_o.view(torch.int32)), f"reindex_topk B={B} S={S} N={N}"
        assert torch.equal(out_n, out_o)


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["hoisted", "two_warpgroups_hoisted"], ids=str)
def test_prmt_rs2_matches_reference(option):
    """prmt_rs2 with the hoisted epilogue (fused: FUSED_OPTIONS) against the reference at the real and odd shapes."""
    _assert_indexer_matches_reference({**PRMT_RS2_OPTIONS[option], "dequant": "prmt_rs2"}, option)


@pytest.mark.gpu
def test_ties_and_wrappers():
    inputs = ix_reference.indexer_inputs(4, 2, 32768, 5, "cuda", causal=False)
    inputs["k_packed"] = inputs["k_packed"][:, :64].repeat(1, 512, 1).contiguous()  # 64 distinct keys: every score repeats
    inputs["k_scales"] = inputs["k_scales"][:, :64].repeat(1, 512, 1).contiguous()
    args = (inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"])
    out, scores = _indexer_call(inputs, None, "ties")
    assert torch.equal(out, topk_positions(scores, 512))  # the select kernel follows the tie rule exactly
    pool = _call_twice(lambda: ix.candidate_pool(scores, inputs["n_visible"]))
    assert torch.equal(pool, candidate_blocks(scores, inputs["n_visible"], 8, 2048))
    got = _call_twice(lambda: ix.reindex_topk(*args, pool, 8, 512))
    inputs["pool_blocks"] = pool
    ref = ix.REINDEX_TOPK.reference(inputs)
    assert ix.compare_topk_sets(got, ref["topk"], ref["scores"]).ok


@pytest.mark.parametrize("tile", [ix.CANDIDATE_POOL, ix.REINDEX_TOPK], ids=lambda t: t.name)
@pytest.mark.slow
def test_pool_and_reindex_select_defaults(tile):
    """Hopper's default is the two-pass select (timed on the H200); other arches keep the multipass select
    (not timed there); both stay in the space and compile."""
    shape = tile.shape("decode_b64_n128k")
    assert tile.default_config(SM90)["select_algo"] == "two_pass"
    assert tile.default_config(get_arch("sm80"))["select_algo"] == "multipass"
    cfg = {**tile.default_config(SM90), "select_algo": "multipass"}
    assert tile.search_space(SM90).violations(cfg, shape, SM90) == []
    assert tile.build(shape, cfg, SM90)[0]["select_algo"] == "multipass"


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [ix.INDEXER_TOPK, ix.CANDIDATE_POOL], ids=lambda t: t.name)
def test_65536_query_rows_launch(tile):
    """A 64K prefill has 65536 query rows: grid y stops at 65535, so the score and block-max kernels fold
    the rows into grid x (the first 64K CED prefill on the H200 failed to launch with grid=(16, 65536, 1))."""
    arch = get_arch("sm90")
    ev = evaluate(tile, _odd(1, 65536, 600), tile.default_config(arch), arch, seed=5, time_it=False)
    assert ev.outcome == OK, ev.message


def _select_like_the_kernel(values, n_valid, _blocks, out):
    """The select kernel's contract in torch: per row the k best of columns < n_valid (-inf never chosen),
    ties to the lower position, positions ascending, -1 fill."""
    R, L = values.shape
    k = out.shape[1]
    for r in range(R):
        n = int(min(n_valid[r], L))
        row = values[r, :n]
        cols = [j for j in range(n) if row[j] > float("-inf")]
        cols.sort(key=lambda j: (-float(row[j]), j))
        keep = sorted(cols[:k])
        out[r] = torch.tensor(keep + [-1] * (k - len(keep)), dtype=torch.int32)


@pytest.mark.parametrize("parts", [1, 2, 4, 8])
def test_select_in_parts_equals_one_piece(parts):
    """The split select keeps exactly what one select over the whole row keeps, ties and -inf included."""
    g = torch.Generator().manual_seed(parts)
    R, N, k = 6, 64, 7
    scores = torch.randint(0, 9, (R, N), generator=g).float()  # many ties
    scores[0, 10:] = float("-inf")  # fewer candidates than k in most parts
    scores[1] = 3.0  # one big tie
    nvis = torch.tensor([N, N, 37, 5, 0, N], dtype=torch.int32)
    want = torch.empty(R, k, dtype=torch.int32)
    _select_like_the_kernel(scores, nvis, None, want)
    got = torch.full((R, k), -7, dtype=torch.int32)
    ix_launch._select_in_parts(_select_like_the_kernel, parts, scores, nvis, got)
    assert torch.equal(got, want)


def test_select_split_auto_fills_the_gpu_and_keeps_parts_wide():
    sm90 = get_arch("sm90")  # 132 SMs
    assert ix.resolve_select_split("auto", 64, 131072, 512, sm90) == 8  # decode B=64: 8 x 64 rows >= 2 x 132
    assert ix.resolve_select_split("auto", 128, 131072, 512, sm90) == 4
    assert ix.resolve_select_split("auto", 4096, 4096, 512, sm90) == 1  # prefill rows fill the GPU alone
    assert ix.resolve_select_split("auto", 1, 8192, 512, sm90) == 4  # parts stay >= 4k = 2048 wide
    assert ix.resolve_select_split("auto", 1, 1000, 512, sm90) == 1
    assert ix.resolve_select_split(4, 4096, 4096, 512, sm90) == 4  # an explicit setting is kept


@pytest.mark.gpu
@pytest.mark.parametrize("parts", ["auto", 2, 4, 8])
def test_select_split_matches_reference(parts):
    arch = get_arch("sm90")
    tile = ix.INDEXER_TOPK
    cfg = {**tile.default_config(arch), "select_split": parts}
    for shape in [tile.shape("decode_b64_n32k"), tile.shape("decode_b1_n128k"), _odd(3, 2, 1000), _odd(2, 1, 77)]:
        ev = evaluate(tile, shape, cfg, arch, seed=6, time_it=False)
        assert ev.outcome == OK, f"split {parts} {shape.name}: {ev.message}"


def test_indexer_kernel_key_follows_what_its_launch_resolves():
    """indexer_topk's Tile.kernel_key: tiles_per_cta="auto" keys as the tile count the score launch resolves it to,
    and under the two-pass select the multipass select's keys (which its launch never reads) do not count; the tuner
    then measures such configs once."""
    from tiles.core.registry import get_tile

    sm90, tile = SM90, get_tile("indexer_topk")
    for shape_name, tiles in (("decode_b64_n128k", 16), ("decode_b1_n128k", 4)):
        shape = tile.shape(shape_name)
        assert tile.default_config(sm90)["select_algo"] == "two_pass"
        key = tile.kernel_key(shape, {}, sm90)
        assert key == tile.kernel_key(shape, {"tiles_per_cta": tiles}, sm90) == tile.kernel_key(shape, {"select_threads": 512}, sm90)
        assert key != tile.kernel_key(shape, {"tiles_per_cta": 1}, sm90)
        multipass = {"select_algo": "multipass"}
        assert tile.kernel_key(shape, multipass, sm90) != tile.kernel_key(shape, {**multipass, "select_threads": 512}, sm90)


def test_reference_scores_in_chunks_equal_one_piece(monkeypatch):
    """The reference scores a few batch rows at a time when the whole batch would not fit (the 1M-entry decode shape
    asked for 64 GiB at once); the chunks compute exactly what one piece does."""
    from tiles.indexer import reference

    inputs = reference.indexer_inputs(5, 2, 300, seed=3, device="cpu", causal=False)
    whole = reference.reference_scores(inputs)
    assert reference.reference_rows_per_chunk(5, 2, 300) == 5
    assert reference.reference_rows_per_chunk(64, 1, 1 << 20) == 2  # the 1M decode shape: 32 chunks of 1.5 GiB
    monkeypatch.setattr(reference, "REFERENCE_CHUNK_BYTES", 300 * (128 * 4 + 2 * 2 * 32 * 4) * 2)  # two rows a chunk
    assert reference.reference_rows_per_chunk(5, 2, 300) == 2
    assert torch.equal(reference.reference_scores(inputs), whole)
