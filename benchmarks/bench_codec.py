"""The zstd settings of chunkstore's codecs, measured on the byte planes they compress.

Float tensors reach zstd as byte planes (shuffle-zstd) or as byte planes of an
XOR with the previous save (xor-delta).  This compares zstd's level 1 with the
settings :data:`chunkstore.codecs.zstd.PLANE_PARAMETERS` uses for planes, on planes of the
kinds a training state has: weights, Adam's second moment, bfloat16, and XORs
of a dense and of a sparse update; and, for contrast, whole int64 chunks, which
keep level 1 (their repeats are real).  Throughput is per core, one plane
of 1 Mi elements at a time.  Usage::

    python -m benchmarks.bench_codec --out benchmarks/results/codec.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from chunkstore.codecs.zstd import PLANE_PARAMETERS as PARAMETERS

ELEMENTS = 1 << 20


def _seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _planes(array: np.ndarray) -> np.ndarray:
    size = array.dtype.itemsize
    return np.ascontiguousarray(array.view(np.uint8).reshape(-1, size).T)


def _xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.view(np.uint8) ^ b.view(np.uint8)).view(a.dtype)


def cases(seed: int = 0) -> dict[str, np.ndarray]:
    """Byte planes of one 1 Mi-element chunk of each kind, by name."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal(ELEMENTS) * 0.02).astype(np.float32)
    grad = (rng.standard_normal(ELEMENTS) * 0.02).astype(np.float32)
    second = (grad * grad * 1e-3).astype(np.float32)
    stepped = (weights - 1e-5 * grad / (np.sqrt(second) + 1e-8)).astype(np.float32)
    sparse = weights.copy()
    rows = rng.choice(ELEMENTS // 64, ELEMENTS // 64 // 50, replace=False)
    sparse.reshape(-1, 64)[rows] += 0.001
    bf16 = (weights.view(np.uint32) >> 16).astype(np.uint16)
    ids = rng.integers(0, 50_000, ELEMENTS // 8).astype(np.int64).view(np.uint8)
    w, v, d, s = _planes(weights), _planes(second), _planes(_xor(weights, stepped)), \
        _planes(_xor(weights, sparse))
    b = _planes(bf16)
    return {
        "fp32 weights, exponent plane": w[3], "fp32 weights, mantissa plane": w[2],
        "adam exp_avg_sq, exponent plane": v[3], "adam exp_avg_sq, mantissa plane": v[2],
        "xor of a dense step, plane 3": d[3], "xor of a dense step, plane 2": d[2],
        "xor of a dense step, plane 1": d[1], "xor of a sparse step, plane 2": s[2],
        "xor of a sparse step, plane 0": s[0], "bf16 weights, high plane": b[1],
        "bf16 weights, low plane": b[0], "int64 ids (whole chunk)": ids,
    }


def measure(repeat: int) -> dict[str, Any]:
    settings = {
        "level 1": zstandard.ZstdCompressor(level=1, write_content_size=True),
        "chunkstore": zstandard.ZstdCompressor(compression_params=PARAMETERS),
    }
    decompressor = zstandard.ZstdDecompressor()
    rows: list[dict[str, Any]] = []
    totals = {name: {"raw": 0, "stored": 0, "encode_s": 0.0, "decode_s": 0.0}
              for name in settings}
    for case, plane in cases().items():
        data = plane.data
        row: dict[str, Any] = {"case": case, "bytes": len(data)}
        for name, compressor in settings.items():
            frame = compressor.compress(data)
            encode_s = _seconds(lambda c=compressor, d=data: c.compress(d), repeat)
            decode_s = _seconds(lambda f=frame: decompressor.decompress(f), repeat)
            row[name] = {"ratio": round(len(frame) / len(data), 4),
                         "encode_gb_s": round(len(data) / encode_s / 1e9, 3),
                         "decode_gb_s": round(len(data) / decode_s / 1e9, 3)}
            total = totals[name]
            total["raw"] += len(data)
            # A plane that does not shrink is stored raw by the codecs.
            total["stored"] += min(len(frame), len(data))
            total["encode_s"] += encode_s
            total["decode_s"] += decode_s
        rows.append(row)
    summary = {name: {"ratio": round(t["stored"] / t["raw"], 4),
                      "encode_gb_s": round(t["raw"] / t["encode_s"] / 1e9, 3),
                      "decode_gb_s": round(t["raw"] / t["decode_s"] / 1e9, 3)}
               for name, t in totals.items()}
    return {"cases": rows, "all planes": summary}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/codec.json")
    args = parser.parse_args(argv)
    result = {
        "command": "python -m benchmarks.bench_codec",
        "machine": {"python": platform.python_version(), "zstandard": zstandard.__version__,
                    "zstd": ".".join(map(str, zstandard.ZSTD_VERSION))},
        "parameters": {"window_log": PARAMETERS.window_log, "hash_log": PARAMETERS.hash_log,
                       "chain_log": PARAMETERS.chain_log, "search_log": PARAMETERS.search_log,
                       "min_match": PARAMETERS.min_match, "strategy": PARAMETERS.strategy},
        **measure(args.repeat),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for row in result["cases"]:
        print(f"{row['case']:34s} " + "  ".join(
            f"{name}: {v['ratio']:.3f} @ {v['encode_gb_s']:.2f}/{v['decode_gb_s']:.2f} GB/s"
            for name, v in row.items() if isinstance(v, dict)))
    print("all planes:", json.dumps(result["all planes"]))


if __name__ == "__main__":
    main()
