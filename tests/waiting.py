"""Waiting in tests: for a condition, with a deadline that names what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(condition: Callable[[], T], what: str, timeout_s: float = 30, every_s: float = 0.2) -> T:
    """`condition()`'s first true value, asked every `every_s`; fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not {what} in {timeout_s} s"
        time.sleep(every_s)
    return value
