"""The embedded model's cache key: what a build depends on changes it, and nothing else."""

from tiderl.config import load_config
from tiderl.embedded import build as embedded


def test_math_key_follows_the_generator_source(monkeypatch):
    cfg = load_config("configs/math_place_sao_tiny.yaml", [])
    before = embedded.build_key(cfg)
    assert embedded.build_key(cfg) == before  # deterministic
    monkeypatch.setattr(embedded, "_source_digest", lambda modules: "changed")
    assert embedded.build_key(cfg) != before


def test_kg_key_does_not_read_math_sources(monkeypatch):
    cfg = load_config("configs/kg_sao_tiny.yaml", [])
    before = embedded.build_key(cfg)
    monkeypatch.setattr(embedded, "_source_digest", lambda modules: "changed")
    assert embedded.build_key(cfg) == before


def test_source_digest_reads_the_files():
    digest = embedded._source_digest(("tiderl.envs.math.data",))
    assert len(digest) == 16 and digest != embedded._source_digest(("tiderl.envs.math.setup",))


def test_copy_check_settings_key_the_build_only_when_it_is_on():
    cfg = load_config("configs/math_place_sao_tiny.yaml", [])
    assert cfg.model.warmstart.copy_check_threshold > 0
    key = embedded.build_key(cfg)
    for override in ("model.warmstart.copy_check_threshold=0.8", "model.warmstart.copy_check_every=10",
                     "model.warmstart.copy_check_size=100", "model.warmstart.steps=900"):
        assert embedded.build_key(load_config("configs/math_place_sao_tiny.yaml", [override])) != key, override
    # Off: its other settings do not matter, so builds without it keep their keys (and caches).
    off = load_config("configs/kg_sao_tiny.yaml", [])
    assert off.model.warmstart.copy_check_threshold == 0
    assert embedded.build_key(load_config("configs/kg_sao_tiny.yaml", ["model.warmstart.copy_check_every=10"])) \
        == embedded.build_key(off)
