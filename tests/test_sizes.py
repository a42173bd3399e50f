"""Sizes: one parser (lazyckpt/sizes.py) for every size the library takes --
arguments, Options fields and LAZYCKPT_* variables alike."""

from __future__ import annotations

import pytest
import torch

import lazyckpt
from lazyckpt import knobs
from lazyckpt.sizes import parse_size

MiB = 1 << 20


# ---------------------------------------------------------------------- the two reported bugs

def test_a_size_in_the_environment_may_carry_a_unit(monkeypatch):
    """Was: ValueError: invalid literal for int() with base 10: '64M'."""
    monkeypatch.setenv("LAZYCKPT_HOST_CACHE_BYTES", "64M")
    monkeypatch.setenv("LAZYCKPT_CHUNK_BYTES", "1MiB")
    monkeypatch.setenv("LAZYCKPT_MAX_FOOTER_BYTES", "1GB")
    monkeypatch.setenv("LAZYCKPT_PERSIST_BANDWIDTH", "100MB")
    options = knobs.resolve()
    assert options.host_cache_bytes == 64 * MiB
    assert options.chunk_bytes == MiB
    assert options.max_footer_bytes == 10 ** 9
    assert options.persist_bandwidth == 100 * 10 ** 6


def test_host_cache_bytes_may_be_a_string_everywhere(tmp_path):
    """Was: TypeError: '<' not supported between instances of 'str' and 'int'."""
    assert knobs.Options(host_cache_bytes="64M").host_cache_bytes == 64 * MiB
    assert knobs.resolve(host_cache_bytes="2MiB").host_cache_bytes == 2 * MiB
    with lazyckpt.Checkpointer(tmp_path / "run", host_cache_bytes="1M") as ck:
        assert ck.options.host_cache_bytes == MiB
        ck.save({"w": torch.arange(1000.0)}, 1).wait()
        assert torch.equal(ck.load()["w"], torch.arange(1000.0))


# ---------------------------------------------------------------------- the parser

@pytest.mark.parametrize("text, expected", [
    (4096, 4096), ("4096", 4096), (" 4096 ", 4096), ("4096B", 4096), ("0", 0),
    ("64M", 64 * MiB), ("64m", 64 * MiB), ("64MiB", 64 * MiB), ("64mib", 64 * MiB), ("64 MiB", 64 * MiB),
    ("512k", 512 << 10), ("512KiB", 512 << 10), ("2G", 2 << 30), ("2GiB", 2 << 30), ("1T", 1 << 40),
    ("1.5GiB", 3 << 29), ("1.5G", 3 << 29), (".5M", MiB // 2),
    ("5GB", 5 * 10 ** 9), ("5kB", 5000), ("5KB", 5000), ("5MB", 5 * 10 ** 6), ("2TB", 2 * 10 ** 12),
    ("1.5MB", 1_500_000), (1e6, 1_000_000), (2.0, 2),
])
def test_sizes_parse(text, expected):
    value = parse_size(text, "chunk_bytes")
    assert value == expected and type(value) is int


@pytest.mark.parametrize("bad", ["", "M", "64X", "64 MBs", "-1", "1e6", "64Mi", "1,000", "nan", "inf",
                                 -5, float("nan"), float("inf"), True, None, [64], "64MM"])
def test_a_bad_size_names_the_option_and_gives_examples(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad, "host_cache_bytes")
    message = str(info.value)
    assert "host_cache_bytes" in message and "64M" in message and "5GB" in message, message


def test_knobs_parse_size_keeps_its_name_and_refuses_zero():
    assert knobs.parse_size("256M") == 256 * MiB
    assert knobs.parse_size("1.5GiB") == 3 << 29
    with pytest.raises(ValueError, match="at least 1 byte"):
        knobs.parse_size("0")


def test_every_size_of_options_goes_through_the_parser():
    o = knobs.Options(chunk_bytes="64k", max_footer_bytes="1MiB", persist_bandwidth="10MB",
                      host_cache_bytes="128KiB")
    assert (o.chunk_bytes, o.max_footer_bytes, o.persist_bandwidth, o.host_cache_bytes) == \
        (64 << 10, MiB, 10 ** 7, 128 << 10)
    with pytest.raises(ValueError, match="chunk_bytes.*examples"):
        knobs.Options(chunk_bytes="lots")


def test_a_bad_size_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("LAZYCKPT_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="LAZYCKPT_CHUNK_BYTES.*examples"):
        knobs.resolve()
