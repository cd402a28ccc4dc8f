"""normlab: normalization layers for transformer language models.

Exact reference math (:mod:`normlab.reference`), a validated functional API that dispatches to
fused backends (:mod:`normlab.functional`), and modules (:mod:`normlab.nn`).
"""

from importlib.metadata import PackageNotFoundError, version

from normlab.functional import add_layer_norm, add_rms_norm, derf, dyt, layer_norm, rms_norm, seq_batch_norm
from normlab.kernels import available_backends, use_backend
from normlab.model import Decoder, ModelConfig
from normlab.nn import Derf, DyT, NORM_KINDS, LayerNorm, RMSNorm, SequenceBatchNorm, build_norm

try:
    __version__ = version("normlab")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "layer_norm",
    "rms_norm",
    "add_layer_norm",
    "add_rms_norm",
    "seq_batch_norm",
    "dyt",
    "derf",
    "LayerNorm",
    "RMSNorm",
    "SequenceBatchNorm",
    "DyT",
    "Derf",
    "build_norm",
    "NORM_KINDS",
    "ModelConfig",
    "Decoder",
    "use_backend",
    "available_backends",
    "__version__",
]
