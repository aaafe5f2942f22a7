"""What some end-to-end tests need from the machine beyond the venv."""

from __future__ import annotations

import os

import pytest


def unless_ci(available: bool, reason: str) -> pytest.MarkDecorator:
    """Skip where `available` is false, but never in CI (`CI` set, as `.ci/run` runs), where `make
    test` installs what these tests need: there a missing tool fails the test instead of hiding it."""
    return pytest.mark.skipif(not available and not os.environ.get("CI"), reason=reason)
