"""Hugging Face transformers integration (``pip install 'normlab[hf]'``).

- :mod:`normlab.hf.patching`: ``patch(model)`` swaps each normalization module of a model for
  normlab's fused op with that family's exact numerics; ``unpatch(model)`` restores it.
- :mod:`normlab.hf.checking`: ``check_model`` (``normlab check-model``) compares a patched model with
  the unpatched one against a float64 copy, on small random models of each architecture
  (``tiny_model``) or on a packaged trained checkpoint.
"""

from normlab.hf.checking import (ARCHS, CHECKPOINTS, ZERO_GRAD, check_model, fetch_checkpoint, load_model,
                                 tiny_model)
from normlab.hf.patching import FLAVORS, FUSABLE_LAYERS, PatchReport, identify, patch, unpatch

__all__ = ["ARCHS", "CHECKPOINTS", "FLAVORS", "FUSABLE_LAYERS", "ZERO_GRAD", "PatchReport", "check_model",
           "fetch_checkpoint", "identify", "load_model", "patch", "tiny_model", "unpatch"]
