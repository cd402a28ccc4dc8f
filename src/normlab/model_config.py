"""The decoder's configuration: ModelConfig (every field typed, checked, with what it means) and
the named sizes. :mod:`normlab.model` builds the decoder from it and says what each field does to
the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from normlab.functional import CASTS, EPS_MODES, check_choice
from normlab.kernels import CHOICES as BACKEND_CHOICES
from normlab.nn import NORM_KINDS

PLACEMENTS = ("post", "pre", "sandwich", "deepnorm")
MLPS = ("swiglu", "gelu", "relu")
POSITIONS = ("rope", "learned", "sinusoidal")
INITS = ("gpt2", "xavier")
DEEPNORM_INITS = ("deepnet", "article")  # DeepNet's gain (8L)^(-1/4), or W / sqrt(L) and / sqrt(2L)
# Whether a final norm sits before the LM head by default (DESIGN.md's placement table).
FINAL_NORM_DEFAULT = {"post": False, "pre": True, "sandwich": True, "deepnorm": False}


@dataclass
class ModelConfig:
    vocab_size: int = 256  # tokens in the vocabulary (the tokenizer sets it)
    d_model: int = 256  # width of the residual stream
    n_layers: int = 4  # decoder blocks
    n_heads: int = 4  # attention heads; d_model must divide by it
    n_kv_heads: int | None = None  # key/value heads for grouped-query attention; None: n_heads
    d_ff: int | None = None  # MLP hidden size; None: 4 d (gelu) or 8/3 d rounded up to 32 (swiglu)
    max_seq_len: int = 256  # longest sequence (rotary tables and generation)
    dropout: float = 0.0  # on attention weights and on each branch output
    mlp: str = "swiglu"  # "swiglu" (Llama), "gelu" (GPT-2) or "relu" (the original Transformer)
    # "rope" (Llama), or absolute positions added to the embedding: "learned", "sinusoidal"
    positions: str = "rope"
    embed_scale: bool = False  # token embeddings ~ N(0, 1/d) times sqrt(d) (the original Transformer)
    # token embeddings times a learned scalar started here (Zhu et al.'s Llama with DyT: sqrt(d))
    embed_gain: float | None = None
    rope_theta: float = 10000.0  # rotary base
    tie_embeddings: bool = True  # the LM head shares the embedding matrix
    # layernorm, rmsnorm, prmsnorm, l2, scalenorm, batchnorm, dyt or derf (not norms: their replacements),
    # none
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5  # epsilon of every norm
    norm_cast: str = "llama"  # RMSNorm cast order: "llama" or "gemma"
    norm_partial: float | None = None  # pRMSNorm's p; None: 0.0625 for prmsnorm (only prmsnorm takes it)
    norm_eps_mode: str = "inside"  # RMSNorm: eps inside or outside the square root
    norm_weightless: bool = False  # norms without a learned scale (and bias)
    # norm="dyt" or "derf": the initial alpha of every DyT or Derf (Zhu et al. 2025's default)
    dyt_alpha0: float = 0.5
    # in training, shift every norm's input row by N(0, (this * the row's RMS)^2), one draw per
    # row (invariance preset)
    norm_shift_noise: float = 0.0
    placement: str = "pre"  # post, pre, sandwich or deepnorm
    final_norm: bool | None = None  # a norm before the LM head; None: the placement's default
    embed_norm: bool = False  # a norm (the model's kind) on the embeddings before the first block (Bloom's)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3, OLMo 2)
    # pre only: layer l's norms' outputs times 1/sqrt(l) (Sun et al. 2025's LayerNorm Scaling)
    ln_scaling: bool = False
    deepnorm_alpha: float | None = None  # residual scale; None: (2 L)^(1/4)
    deepnorm_beta: float | None = None  # init gain; None: (8 L)^(-1/4)
    # "deepnet" (xavier, gain beta) or "article" (xavier / sqrt(L), / sqrt(2L))
    deepnorm_init: str = "deepnet"
    backend: str | None = None  # normlab backend for the norms; None: auto
    norm_impl: str = "normlab"  # "torch": torch.nn.LayerNorm / nn.RMSNorm instead (speed comparisons)
    init_std: float = 0.02  # std of the normal init (not used by deepnorm's xavier groups)
    # block weights: "gpt2" (N(0, init_std), output projections / sqrt(2 L)) or "xavier" (Xiong et al.,
    # DeepNet baselines)
    init: str = "gpt2"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def choice(name, valid):
            check_choice(getattr(self, name), name, valid)

        def number(name, zero_ok=False, note="", none_ok=False):
            """The field a finite real > 0 (>= 0 with ``zero_ok``), or None with ``none_ok``."""
            value = getattr(self, name)
            if value is None and none_ok:
                return
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not (value >= 0 if zero_ok else value > 0):
                raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0{note}, got "
                                 f"{value!r}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        choice("norm", NORM_KINDS)
        choice("placement", PLACEMENTS)
        choice("mlp", MLPS)
        choice("positions", POSITIONS)
        choice("norm_cast", CASTS)
        choice("norm_eps_mode", EPS_MODES)
        if self.backend is not None:
            choice("backend", BACKEND_CHOICES)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                             "change one of them")
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim = d_model / n_heads = {self.d_model // self.n_heads} must be even "
                             "for rotary embeddings")
        if self.n_kv_heads is not None and (isinstance(self.n_kv_heads, bool)
                                            or not isinstance(self.n_kv_heads, int)
                                            or self.n_kv_heads < 1):
            raise ValueError("n_kv_heads must be a positive int or None (None: n_heads), got "
                             f"{self.n_kv_heads!r}")
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})")
        if self.norm_partial is not None:
            if self.norm != "prmsnorm":
                raise ValueError(f"norm_partial is set ({self.norm_partial}) but norm is {self.norm!r}; use "
                                 "norm='prmsnorm' or drop norm_partial")
            if not 0 < self.norm_partial <= 1:
                raise ValueError(f"norm_partial must be in (0, 1], got {self.norm_partial}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout,
                                                            (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        number("rope_theta")
        number("init_std")
        number("deepnorm_alpha", note=" or None (None: DeepNet's value)", none_ok=True)
        number("deepnorm_beta", note=" or None (None: DeepNet's value)", none_ok=True)
        number("embed_gain", note=" or None (None: no gain)", none_ok=True)
        if self.embed_gain is not None and self.embed_scale:
            raise ValueError("embed_gain and embed_scale both scale the token embeddings; set one of them")
        if self.norm_eps < 0 or not math.isfinite(self.norm_eps):
            raise ValueError(f"norm_eps must be a finite number >= 0, got {self.norm_eps}")
        number("dyt_alpha0", note=" (DyT's and Derf's initial alpha)")
        number("norm_shift_noise", zero_ok=True, note=" (0: none)")
        choice("norm_impl", ("normlab", "torch"))
        for name in ("embed_norm", "qk_norm", "ln_scaling", "norm_weightless", "embed_scale",
                     "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        choice("init", INITS)
        choice("deepnorm_init", DEEPNORM_INITS)
        if self.ln_scaling and self.placement != "pre":
            raise ValueError(f"ln_scaling scales Pre-LN's norm outputs and applies to placement='pre' only, "
                             f"not {self.placement!r}")
        if self.deepnorm_init != "deepnet" and self.placement != "deepnorm":
            raise ValueError(f"deepnorm_init={self.deepnorm_init!r} applies to placement='deepnorm' only, "
                             f"not {self.placement!r}")
        if self.norm_weightless and self.norm == "scalenorm":
            raise ValueError("norm_weightless: norm='scalenorm' has one scalar gain and no per-feature "
                             "weights to drop")
        if self.norm_impl == "torch" and self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm_impl='torch' exists for layernorm and rmsnorm only, not {self.norm!r}")
        if self.d_ff is not None and (isinstance(self.d_ff, bool) or not isinstance(self.d_ff, int)
                                      or self.d_ff < 1):
            raise ValueError(f"d_ff must be a positive int or None, got {self.d_ff!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ff_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp in ("gelu", "relu"):
            return 4 * self.d_model
        return 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def has_final_norm(self) -> bool:
        return FINAL_NORM_DEFAULT[self.placement] if self.final_norm is None else self.final_norm

    @property
    def alpha(self) -> float:
        """DeepNorm's residual scale (2L)^(1/4) for a decoder of L layers."""
        return (2 * self.n_layers) ** 0.25 if self.deepnorm_alpha is None else self.deepnorm_alpha

    @property
    def beta(self) -> float:
        """DeepNorm's init gain (8L)^(-1/4)."""
        return (8 * self.n_layers) ** -0.25 if self.deepnorm_beta is None else self.deepnorm_beta

    def norm_options(self) -> dict:
        opts: dict = {"eps": self.norm_eps} if self.norm not in ("dyt",
                                                                 "derf") else {"alpha0": self.dyt_alpha0}
        if self.norm in ("rmsnorm", "prmsnorm"):
            opts.update(cast=self.norm_cast, eps_mode=self.norm_eps_mode)
            if self.norm == "prmsnorm" and self.norm_partial is not None:
                opts["partial"] = self.norm_partial
        if self.norm in ("layernorm", "rmsnorm", "prmsnorm", "l2", "scalenorm", "dyt",
                         "derf") and self.backend is not None:
            opts["backend"] = self.backend
        if self.norm_weightless:
            opts["weightless"] = True
        if self.norm == "none":
            opts = {}
        return opts

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


# Named sizes. "tiny": tests (28,832 parameters); "small": the CPU lab (3,279,104 with a 256 vocab);
# "medium": a GPU, GPT-2-small-like (109,529,856; 84,953,856 without the embedding).
PRESETS: dict[str, ModelConfig] = {}
PRESETS["tiny"] = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
PRESETS["small"] = ModelConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=4, max_seq_len=256)
PRESETS["medium"] = ModelConfig(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024)
