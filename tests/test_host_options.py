"""Configuration reaches the transport unchanged."""

from __future__ import annotations

from transport.codecs import CodecSpec

from swarmd.config import load_config
from swarmd.node.host_options import codec_spec, host_options


def test_wire_and_network_sections_become_host_options(tmp_path) -> None:
    path = tmp_path / "swarmd.toml"
    path.write_text('[network]\nmax_connections = 77\nhandshake_timeout_s = 2.5\n'
                    '[wire]\ncodec = "int8+zstd"\nint8_block_size = 128\nmax_message_bytes = 1048576\n')
    config = load_config(path, env={"SWARMD_WIRE_ZSTD_LEVEL": "3"})
    options = host_options(config)
    assert options.max_connections == 77
    assert options.handshake_timeout_s == 2.5
    assert options.limits.max_message_bytes == 1 << 20
    assert options.codec == CodecSpec(name="int8+zstd", block_size=128, zstd_level=3)
    assert options.listen == tuple(config.network.listen)


def test_listen_override_wins() -> None:
    config = load_config(None, env={})
    assert host_options(config, ["/ip4/127.0.0.1/tcp/0"]).listen == ("/ip4/127.0.0.1/tcp/0",)
    assert codec_spec(config).name == config.wire.codec


def test_lowbit_codecs_take_their_own_settings() -> None:
    """By default int2 is centred in blocks of 512 (a quarter of int8's bytes for a message of
    512 tokens), activations rounded to nearest and gradients stochastically (unbiased)."""
    spec = codec_spec(load_config(None, env={"SWARMD_WIRE_CODEC": "int2"}))
    assert (spec.block_size, spec.scale_dtype, spec.center, spec.rounding) == (
        512, "bfloat16", True, "nearest")
    assert spec.for_kind("backward").rounding == spec.for_kind("grad").rounding == "stochastic"
    assert not spec.for_kind("backward").center and not spec.for_kind("grad").center
    assert spec.for_kind("forward") is spec
    # gradients (stochastic codes crowd the inner levels) are compressed with zstd
    assert spec.for_kind("backward").name == spec.for_kind("grad").name == "int2+zstd"
    spec = codec_spec(load_config(None, env={"SWARMD_WIRE_CODEC": "int2",
                                             "SWARMD_WIRE_LOWBIT_CENTER": "false",
                                             "SWARMD_WIRE_LOWBIT_ROUNDING": "nearest",
                                             "SWARMD_WIRE_LOWBIT_ZSTD": "off"}))
    assert (spec.block_size, spec.center, spec.kind_rounding, spec.zstd_kinds) == (
        256, False, (), ())
    assert spec.for_kind("backward") is spec
    assert codec_spec(load_config(None, env={"SWARMD_WIRE_CODEC": "int4"})).block_size == 64
    spec = codec_spec(load_config(None, env={"SWARMD_WIRE_CODEC": "int4+zstd",
                                             "SWARMD_WIRE_LOWBIT_BLOCK_SIZE": "128",
                                             "SWARMD_WIRE_LOWBIT_ROUNDING": "stochastic"}))
    assert (spec.block_size, spec.center, spec.rounding, spec.kind_rounding) == (
        128, True, "stochastic", ())
