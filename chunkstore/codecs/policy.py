"""Which codec encodes a chunk.

A policy is a store setting.  ``auto`` picks shuffle-zstd for multi-byte
floating-point chunks and zstd for the rest, probes a small prefix first so
incompressible chunks cost almost nothing, and stores raw whatever does not
save at least ``MIN_SAVING`` of its size; a writer stores a tensor of one chunk
under ``RAW_TENSOR_BYTES`` raw (:func:`tensor_policy`).
"""

from __future__ import annotations

from chunkstore import codecs
from chunkstore.errors import InvalidSettingError
from chunkstore.format.dtypes import FLOAT_NAMES

POLICIES = ("none", "zstd", "shuffle-zstd", "auto")
MIN_SAVING = 0.05
PROBE_BYTES = 64 * 1024
#: Under ``auto`` a tensor of one chunk smaller than this is stored raw (a handle's
#: ``raw_tensor_bytes``).  Compressing pays in time where the bytes it saves take longer to
#: write than compressing them takes on the cores doing it: at least write speed /
#: cores bytes saved per CPU-second (``python -m benchmarks.bench_compress_rule``,
#: ``benchmarks/results/compress_rule.json``).  Per call costs rule small tensors: on
#: the suite's states one float tensor of at most 8 KiB took 7-23 us to encode and
#: saved at most 64 MB per CPU-second (those of 256 KiB 230-270), which with two cores
#: pays only where writing runs under ~130 MB/s; this machine's disk wrote and fsynced
#: 0.33-1.7 GB/s.  LoRA's 288 adapter matrices are such tensors.
RAW_TENSOR_BYTES = 16 * 1024


def check_policy(name: str) -> str:
    if name not in POLICIES:
        choices = ", ".join(POLICIES)
        raise InvalidSettingError(f"unknown compression {name!r}; choose one of {choices}")
    return name


def tensor_policy(policy: str, tensor_bytes: int, raw_below: int) -> str:
    """The policy a tensor of ``tensor_bytes`` is stored with: ``none`` under ``auto``
    when it is smaller than ``raw_below``, else ``policy``."""
    return "none" if policy == "auto" and tensor_bytes < raw_below else policy


def _candidate(policy: str, dtype_name: str, element_size: int) -> codecs.Codec:
    if policy == "none":
        return codecs.RAW
    shuffle_ok = element_size > 1
    if policy == "shuffle-zstd" and shuffle_ok:
        return codecs.SHUFFLE_ZSTD
    if policy == "auto" and shuffle_ok and dtype_name in FLOAT_NAMES:
        return codecs.SHUFFLE_ZSTD
    return codecs.ZSTD


def encode_with_policy(
    policy: str, raw: memoryview, dtype_name: str, element_size: int
) -> tuple[codecs.Codec, bytes | memoryview]:
    """Return the codec used and the payload; raw when compression does not pay."""
    codec = _candidate(policy, dtype_name, element_size)
    if codec is codecs.RAW or not raw:
        return codecs.RAW, raw
    if len(raw) > 4 * PROBE_BYTES:
        probe_len = PROBE_BYTES - PROBE_BYTES % element_size
        probe = codec.encode(raw[:probe_len], element_size)
        if len(probe) > (1 - MIN_SAVING) * probe_len:
            return codecs.RAW, raw
    payload = codec.encode(raw, element_size)
    if len(payload) > (1 - MIN_SAVING) * len(raw):
        return codecs.RAW, raw
    return codec, payload
