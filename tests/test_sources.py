"""`lab sources` and Tile.kernel_sources: every tile's kernels are found, hashed the same twice, written out on request.

The command is how a change proves it left a default's generated CUDA unchanged, so a tile whose kernels it cannot
see would make that proof vacuous: every registered tile must yield at least one kernel source.
"""

from __future__ import annotations

import pytest

from lab.cli import main
from tiles.core.arch import get_arch
from tiles.core.registry import all_tiles

ARCHS = ("sm90", "sm80")


@pytest.mark.parametrize("arch_name", ARCHS)
@pytest.mark.parametrize("tile", list(all_tiles().values()), ids=lambda t: t.name)
def test_every_tile_yields_its_kernel_sources(tile, arch_name):
    arch = get_arch(arch_name)
    if tile.support_reason(arch):
        pytest.skip(tile.support_reason(arch))
    shape = tile.shapes()[0]
    sources = tile.kernel_sources(shape, {}, arch)
    assert sources, f"{tile.name}: no kernel sources found"
    for name, src in sources.items():
        assert "__global__" in src, (tile.name, name)


def _lines(capsys, *argv: str) -> list[str]:
    assert main(["sources", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_hashes_are_stable_and_name_every_kernel(capsys):
    first = _lines(capsys, "--arch", "sm90", "--tile", "sparse_attn_decode,indexer_topk,compressor")
    assert _lines(capsys, "--arch", "sm90", "--tile", "sparse_attn_decode,indexer_topk,compressor") == first
    kernels = {tuple(line.split()[1:4]) for line in first}
    assert ("sparse_attn_decode", "decode_b1_s1", "main") in kernels and ("sparse_attn_decode", "decode_b1_s1", "combine") in kernels
    assert {k for t, _, k in kernels if t == "indexer_topk"} >= {"score", "select"}


@pytest.mark.slow
def test_a_config_changes_the_source_and_an_invalid_one_is_named(capsys):
    default = _lines(capsys, "--arch", "sm90", "--tile", "sparse_attn_prefill")
    column = _lines(capsys, "--arch", "sm90", "--tile", "sparse_attn_prefill", "--config", '{"lanes": "column"}')
    assert default != column
    invalid = _lines(capsys, "--arch", "sm90", "--tile", "sparse_attn_prefill", "--config", '{"block_I": 48}')
    assert len(invalid) == 1 and " invalid: " in invalid[0]


def test_out_writes_each_source(tmp_path, capsys):
    lines = _lines(capsys, "--arch", "sm90", "--tile", "fp4_quant_main", "--out", str(tmp_path))
    written = sorted(tmp_path.rglob("*.cu"))
    assert [p.relative_to(tmp_path).parts[:3] for p in written] == [("sm90", "fp4_quant_main", "decode_b64")]
    assert written[0].read_text().count("\n") == int(lines[0].split()[6])


def test_masked_source_ignores_which_equal_buffer_is_which_but_not_the_instructions():
    """TileLang 0.1.15 swaps the names and offsets of equal-sized shared buffers between processes; the masked digest
    is what a before/after comparison reads, and it must still see a changed instruction."""
    from lab.commands.sources import masked_source

    a = "void* buf_2 = ((void*)((char*)buf_dyn_shmem + 131072));\nx = *(uint4*)(((bfloat16_t*)buf_2) + i);\nf(workspace_1, KV_r_1);"
    b = "void* buf_3 = ((void*)((char*)buf_dyn_shmem + 163840));\nx = *(uint4*)(((bfloat16_t*)buf_3) + i);\nf(workspace, KV_r);"
    assert masked_source(a) == masked_source(b)
    assert masked_source(a) != masked_source(a.replace("+ i)", "+ i + 8)"))


def test_masked_source_ignores_local_names_and_declaration_order_but_not_which_local_is_read():
    """A refactor that moves code into a macro renames TileLang's locals (``__3`` becomes the macro parameter's name)
    and may reorder their declarations (session 21: the seesaw and balanced kernels after their shared prologue and
    epilogue); the masked digest keeps those, and still sees a local read in the wrong place or a resized one."""
    from lab.commands.sources import masked_source

    a = "  float __3[2];\n  float m_i[2];\n  __3[0] = m_i[0] * 2.0f;\n  out[0] = __3[0] + m_i[1];\n"
    b = "  float m_i[2];\n  float sumexp_i[2];\n  sumexp_i[0] = m_i[0] * 2.0f;\n  out[0] = sumexp_i[0] + m_i[1];\n"
    assert masked_source(a) == masked_source(b)
    assert masked_source(a) != masked_source(a.replace("out[0] = __3[0]", "out[0] = m_i[0]"))
    assert masked_source(a) != masked_source(a.replace("float __3[2]", "float __3[4]"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch", "sm42"], "sm42"),
        (["--tile", "nope"], "unknown tile"),
        (["--config", "{not json"], "not valid JSON"),
        (["--config", "[1]"], "must be an object"),
        (["--config", "lanes"], "not key=value"),
        (["--tile", "fp4_quant_main", "--shapes", "huge"], "no shape"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(["sources", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
