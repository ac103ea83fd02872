"""``trillm bench`` reads the engine's settings from their declarations, as ``trillm serve`` does,
and hands the servers it starts exactly the configuration it measured against."""

from __future__ import annotations

import argparse

import attrs
import pytest

from trillm.bench.options import add_parser, server_environment, swept_values
from trillm.engine import EngineConfig, from_env, overrides_from


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trillm")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_every_engine_setting_is_a_bench_flag_and_the_swept_ones_take_lists():
    args = bench_args("--model", "m", "--dtype", "float32", "--kv-cache-mb", "96", "--no-prefix-cache", "--tp", "1,2")
    given = overrides_from(args, EngineConfig)
    assert given == {"model": "m", "dtype": "float32", "kv_cache_bytes": 96 * 2**20, "prefix_cache": False}
    config = from_env(EngineConfig, env={"TRILLM_DP": "3"}, **given)
    assert swept_values(args, config, "tp") == [1, 2]
    assert swept_values(args, config, "dp") == [3]  # not given: the environment's, as the server reads it
    assert swept_values(args, config, "weight_format") == ["auto"]


def test_the_servers_environment_reads_back_as_the_same_configuration():
    config = attrs.evolve(
        EngineConfig(),
        model="engine/configs/llama-3-8b.json",
        kv_cache_bytes=3 * 2**19,  # 1.5 MB: a fractional flag value
        num_pages=None,
        prefix_cache=False,
        stall_timeout=2.5,
        tp=2,
        load_format="dummy",
    )
    assert from_env(EngineConfig, env=server_environment(config)) == config


def test_a_peer_is_a_name_a_url_and_maybe_its_pid():
    from trillm.bench.peers import Peer, parse_peer

    assert parse_peer("llama-server=http://127.0.0.1:8090/") == Peer("llama-server", "http://127.0.0.1:8090")
    assert parse_peer("vllm=http://h:8000,pid=42") == Peer("vllm", "http://h:8000", 42)
    for bad in ("http://h:8000", "x=h:8000", "x=http://h,port=1", "x=http://h,pid=abc", "=http://h"):
        with pytest.raises(ValueError, match="--peer"):
            parse_peer(bad)
    assert bench_args("--peer", "a=http://h:1", "--peer", "b=http://h:2").peer == ["a=http://h:1", "b=http://h:2"]
