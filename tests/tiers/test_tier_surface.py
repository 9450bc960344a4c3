"""The user surface of the tiers: /metrics series per tier, the --kv-tier options of every command."""

from __future__ import annotations

import pytest

from pagedkv_rs.engine.request import SamplingParams
from tier_util import make_engine, prompts


def test_metrics_endpoint_has_per_tier_series(tmp_path):
    from pagedkv_rs.serve.metrics import ServerMetrics

    spec = f"disk:{tmp_path}/kv"
    w = make_engine([spec])
    w.generate(prompts(), SamplingParams(max_tokens=2, temperature=0.0))
    w.shutdown()
    eng = make_engine([spec])
    eng.generate(prompts(), SamplingParams(max_tokens=2, temperature=0.0))
    text = ServerMetrics(eng, "tiny").render().decode()
    label = f'model_name="tiny",tier="disk:{tmp_path}/kv"'
    for name in ("lookups", "hit_blocks", "hit_tokens", "miss_blocks", "verify_failures", "store_drops"):
        assert f"pagedkv:kv_tier_{name}_total{{{label}}}" in text
    assert f"pagedkv:kv_tier_hit_blocks_total{{{label}}} 0.0" not in text
    assert f'pagedkv:kv_tier_lookup_seconds_bucket{{le="+Inf",{label}}}' in text
    assert "kv_tier" not in ServerMetrics(make_engine(), "tiny").render().decode()  # no tiers, no series


@pytest.mark.parametrize("command", ["generate", "serve", "bench.e2e"])
def test_kv_tier_options_on_every_llm_command(command):
    import importlib

    mod = importlib.import_module(f"pagedkv_rs.cli.{command}")
    extra = ["prompt"] if command == "generate" else []
    args = mod.build_parser().parse_args(
        extra + ["--kv-tier", "disk:/tmp/a", "--kv-tier", "redis://h:1/0", "--kv-tier-secret", "s"]
    )
    assert args.kv_tiers == ["disk:/tmp/a", "redis://h:1/0"] and args.kv_tier_secret == "s"
    assert mod.build_parser().parse_args(extra).kv_tiers is None  # without the option nothing changes
