"""Suite-wide setup, run before any test module is collected.

Triton chooses compiled vs interpreted mode when it is first imported, and importing transformers' model classes imports
it; so the CPU interpreter switch is set here, before any test directory's modules import anything.
"""

import os

import torch

# The test deployment's shared KV secret (kv_connectors/kv_auth.py): every connector, pod and router started by a test
# inherits it, as the pods of one real deployment do. Tests of the missing-secret path remove it explicitly.
os.environ.setdefault("PDSERVE_KV_TOKEN", "pdserve-test-kv-secret")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
