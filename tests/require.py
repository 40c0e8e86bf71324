"""Skips that cannot hide missing coverage: a test that cannot run because something is
missing skips saying what, unless KVSERVE_REQUIRE (comma-separated names; .ci/run sets
it) names that thing, and then it fails."""

import os
from typing import NoReturn

import pytest


def required() -> set[str]:
    return {s.strip() for s in os.environ.get("KVSERVE_REQUIRE", "").split(",") if s.strip()}


def missing(name: str, reason: str) -> NoReturn:
    if name in required():
        pytest.fail(f"{name} is required here (KVSERVE_REQUIRE) but missing: {reason}")
    pytest.skip(f"{name} is missing: {reason}")
