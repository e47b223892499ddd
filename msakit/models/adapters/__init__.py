"""Per-family adapters of HF causal LMs (one file per family) and their registry.

Importing this package registers the families msakit ships: llama, mistral, qwen2, qwen3.
Another family is one file: a `FamilyAdapter` subclass and a `register_family` call (see
docs/adapters.md).
"""

from msakit.models.adapters import llama, mistral, qwen2, qwen3  # noqa: F401  (each registers its family)
from msakit.models.adapters import base
from msakit.models.adapters.base import *  # noqa: F403 (the names of base.__all__)

__all__ = list(base.__all__)
