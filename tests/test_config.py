"""Presets and the layer map derived from them (model.config)."""

from __future__ import annotations

import pytest

from model import ConfigError, LayerMode, preset
from model.config import PRESETS


def _counts(cfg):
    plans = cfg.layer_plan()
    return {m: sum(p.mode == m for p in plans) for m in LayerMode}


def test_flash_layer_map_counts():
    counts = _counts(preset("v4.1-flash"))
    assert counts == {LayerMode.FULL: 4, LayerMode.REINDEX: 4, LayerMode.REUSE: 30, LayerMode.SWA_ONLY: 2}


def test_flash_layer_map_matches_the_spec_table():
    plans = preset("v4.1-flash").layer_plan()
    assert [p.index for p in plans if p.mode == LayerMode.SWA_ONLY] == [0, 1]
    assert [p.index for p in plans if p.mode == LayerMode.FULL] == [2, 8, 14, 20]
    assert [p.index for p in plans if p.mode == LayerMode.REINDEX] == [24, 28, 32, 36]
    for p in plans[2:20]:
        assert (p.region, p.ratio) == ("encoder", 2)
        assert p.kv_source == p.index_source == max(s for s in (2, 8, 14) if s <= p.index)
        assert p.pool_source is None
    for p in plans[20:]:
        assert (p.region, p.ratio, p.kv_source) == ("decoder", 1, 20)
        assert p.index_source == max(s for s in (20, 24, 28, 32, 36) if s <= p.index)
        assert p.pool_source == (20 if p.mode == LayerMode.REINDEX else None)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_consistent(name):
    cfg = preset(name)
    plans = cfg.layer_plan()
    assert len(plans) == cfg.n_layers
    for p in plans:
        if p.mode != LayerMode.SWA_ONLY:
            assert plans[p.kv_source].mode == LayerMode.FULL
            assert plans[p.index_source].kv_source == p.kv_source
            assert cfg.compress_ratios[p.kv_source] == p.ratio


def _tiny(**changes):
    return preset("tiny").replace(**changes)


BAD = [
    pytest.param({"compress_ratios": (0, 2, 2, 2, 1, 1, 1)}, "compress_ratios has 7 entries", id="ratios-length"),
    pytest.param({"compress_ratios": (0, 3, 3, 3, 1, 1, 1, 1)}, "must be 0", id="ratio-3"),
    pytest.param({"kv_source_layers": (1, 3, 4, 9)}, "outside", id="source-out-of-range"),
    pytest.param({"kv_source_layers": (0, 1, 3, 4), "index_source_layers": (0, 1, 3, 4, 6)}, "SWA-only", id="source-on-swa-layer"),
    pytest.param({"index_source_layers": (1, 4, 6)}, "must also be index sources", id="kv-source-not-index-source"),
    pytest.param({"compress_ratios": (0, 2, 2, 2, 2, 1, 1, 1)}, "ratio", id="reuse-ratio-differs-from-source"),
    pytest.param(
        {"kv_source_layers": (3, 4), "index_source_layers": (3, 4, 6)}, "no KV source layer precedes", id="no-source-before-layer"
    ),
    pytest.param({"pool_source_layer": None}, "pool_source_layer", id="reindex-without-pool"),
    pytest.param({"index_source_layers": (1, 2, 3, 4, 6)}, "pool source", id="encoder-reindex-reads-other-group"),
    pytest.param({"o_groups": 3}, "o_groups", id="o-groups-do-not-divide"),
    pytest.param({"main_fp4_group": 32}, "main_fp4_group=16", id="main-group-not-16"),
    pytest.param({"head_dim": 40}, "multiples", id="head-dim-not-group-multiple"),
    pytest.param({"rope_dim": 7}, "rope_dim", id="odd-rope-dim"),
    pytest.param({"window": 0}, "window", id="empty-window"),
    pytest.param({"n_encoder_layers": 9}, "n_encoder_layers", id="too-many-encoder-layers"),
]


@pytest.mark.parametrize(("changes", "message"), BAD)
def test_inconsistent_configs_are_rejected(changes, message):
    with pytest.raises(ConfigError, match=message):
        _tiny(**changes)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'huge': choose one of v4.1-flash, small, tiny"):
        preset("huge")
    assert issubclass(ConfigError, ValueError)


def test_softmax_scale_and_ropes():
    cfg = preset("v4.1-flash")
    assert cfg.softmax_scale == 512**-0.5
    assert cfg.swa_rope().theta == 10000.0 and cfg.swa_rope().yarn_factor == 1.0
    comp = cfg.compress_rope()
    assert (comp.theta, comp.yarn_factor, comp.original_seq_len, comp.beta_fast, comp.beta_slow) == (160000.0, 16.0, 65536, 32.0, 1.0)
