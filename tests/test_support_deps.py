"""tests/support/deps.py: a missing optional test dependency skips locally and fails in CI (never a silent skip there)."""

import pytest

from tests.support import deps

MISSING = "pdserve_no_such_module_for_the_test"


@pytest.mark.parametrize("env", [{"PDSERVE_CI": "1"}, {"CI": "true"}])
def test_missing_dependency_fails_in_ci(monkeypatch, env):
    monkeypatch.delenv("PDSERVE_CI", raising=False)
    monkeypatch.delenv("CI", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(pytest.fail.Exception, match="nixl-cu12 is not installed.*broken install"):
        deps.require(MISSING, "nixl-cu12 is not installed")


def test_missing_dependency_skips_locally_with_the_reason(monkeypatch):
    monkeypatch.delenv("PDSERVE_CI", raising=False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"nixl-cu12 is not installed.*{MISSING}"):
        deps.require(MISSING, "nixl-cu12 is not installed")


def test_present_dependency_is_returned(monkeypatch):
    monkeypatch.setenv("PDSERVE_CI", "1")
    assert deps.require("json", "unused").dumps([1]) == "[1]"
