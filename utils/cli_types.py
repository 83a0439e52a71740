"""argparse types for numeric flags, so a value outside its domain is a usage error naming the
flag (argparse prints `argument --micro-batch: ...` and exits 2), never a traceback later."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    value = _parse(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _parse(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _parse(float, text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _parse(kind, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
