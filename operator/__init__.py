"""pdserve.operator: the Kubernetes operator (kopf) reconciling InferenceService resources.

This folder is the package ``pdserve.operator`` (see pyproject.toml). When the repository root is first on sys.path
(``python -m pytest``, ``python -c`` from a checkout) and nothing has imported the standard library's ``operator`` yet,
``import operator`` would find this folder instead and break ``collections`` and everything after it. Imported under
that top-level name, this file therefore loads the standard library module and hands it back.
"""

if __name__ == "operator":
    # Only modules that are loaded before any user code may be used here: anything that imports `collections`
    # (importlib.util, sysconfig...) would re-enter this file half-initialised.
    import _frozen_importlib as _bootstrap
    import _frozen_importlib_external as _external
    import os as _os
    import sys as _sys

    _spec = _external.spec_from_file_location("operator", _os.path.join(_os.path.dirname(_os.__file__), "operator.py"))
    _stdlib = _bootstrap.module_from_spec(_spec)
    _sys.modules["operator"] = _stdlib  # the import system returns what sys.modules holds after this file runs
    _spec.loader.exec_module(_stdlib)
