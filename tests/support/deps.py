"""Optional test dependencies: skipped with the reason on a developer's machine, a loud failure in CI.

`.ci/run` installs the `test` extra (nixl-cu12, the tracing packages) and sets PDSERVE_CI=1; a module-level
``pytest.importorskip`` there turned a broken or missing wheel into silently skipped tests and a green run.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    """PDSERVE_CI=1 (our .ci/run) or the CI variable every hosted CI service sets."""
    return os.environ.get("PDSERVE_CI") == "1" or bool(os.environ.get("CI"))


def require(module: str, reason: str) -> ModuleType:
    """Import `module` for a test module; if it cannot be imported, fail in CI and skip the module elsewhere."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if in_ci():
            pytest.fail(f"{reason} ({e}); CI installs the test extra, so this is a broken install, not a skip",
                        pytrace=False)
        pytest.skip(f"{reason} ({e})", allow_module_level=True)
