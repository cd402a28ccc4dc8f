"""A LLaMA-style decoder where the norm and its placement are config fields.

Token embedding, rotary position embedding, causal grouped-query attention through
``F.scaled_dot_product_attention``, a SwiGLU or GELU MLP, and blocks whose forward shows the four
placements of a norm side by side (F = attention or MLP, N = a norm):

    post      x = N(x + F(x))                   original Transformer, BERT
    pre       x = x + F(N(x))                   GPT-2, Llama
    sandwich  x = x + N_b(F(N_a(x)))            CogView, Gemma 2/3 (Peri-LN)
    deepnorm  x = N(alpha * x + F(x))           DeepNet (Wang et al., 2022)

``ln_scaling=True`` (Pre-LN only) multiplies the output of layer l's two norms by 1/sqrt(l), as
LayerNorm Scaling does (Sun et al. 2025, "The Curse of Depth in Large Language Models").

Initialization: every linear and embedding weight ~ N(0, 0.02), and the two output projections
of each block (attention's ``wo``, the MLP's ``down``) ~ N(0, 0.02 / sqrt(2 L)) (GPT-2's scaled
init). DeepNorm replaces that with the DeepNet init: xavier_normal_ with gain beta =
(8L)^(-1/4) on the value, output projection and all MLP weights, gain 1 on query and key, chosen
by the module's role (attributes of Attention and MLP), never by the text of a parameter name.
``deepnorm_init="article"`` is the init as the article on LayerNorm vs RMSNorm writes it instead:
xavier_normal_ (gain 1) on every block matrix, then the MLP's weights divided by sqrt(L) and
attention's value and output projections by sqrt(2L).
``init="xavier"`` gives every block matrix xavier_normal_ without depth scaling, the setting of
Xiong et al. (2020) and of DeepNet's Post-LN baselines (the lab's warmup, gradients and depth
presets use it: with GPT-2's small scaled init the branches start so small that Post-LN's
gradients are flat across layers at initialization).

The original Transformer's pieces are fields too, so the lab can build the model of Xiong et al.
(2020) from the same code: ``mlp="relu"``, ``positions="learned"`` or ``"sinusoidal"`` (added to
the token embedding, instead of rotary), ``embed_scale=True`` (token embeddings ~ N(0, 1/d),
multiplied by sqrt(d)) and ``tie_embeddings=False``. ``embed_gain=g`` is a piece of the Llama of
Zhu et al. (2025) with DyT: the token embeddings times a learned scalar started at g (theirs:
sqrt(d), 64 at 7B, so that the first DyT sees values of about unit scale; a norm does not need it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as TF
from torch import Tensor, nn

from normlab.functional import CASTS, EPS_MODES, check_choice
from normlab.kernels import CHOICES as BACKEND_CHOICES
from normlab.nn import NORM_KINDS, SequenceBatchNorm, build_norm

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
    positions: str = "rope"  # "rope" (Llama), or absolute positions added to the embedding: "learned", "sinusoidal"
    embed_scale: bool = False  # token embeddings ~ N(0, 1/d) times sqrt(d) (the original Transformer)
    embed_gain: float | None = None  # token embeddings times a learned scalar started here (Zhu et al.'s Llama with DyT: sqrt(d))
    rope_theta: float = 10000.0  # rotary base
    tie_embeddings: bool = True  # the LM head shares the embedding matrix
    norm: str = "rmsnorm"  # layernorm, rmsnorm, prmsnorm, l2, scalenorm, batchnorm, dyt or derf (not norms: their replacements), none
    norm_eps: float = 1e-5  # epsilon of every norm
    norm_cast: str = "llama"  # RMSNorm cast order: "llama" or "gemma"
    norm_partial: float | None = None  # pRMSNorm's p; None: 0.0625 for prmsnorm (only prmsnorm takes it)
    norm_eps_mode: str = "inside"  # RMSNorm: eps inside or outside the square root
    norm_weightless: bool = False  # norms without a learned scale (and bias)
    dyt_alpha0: float = 0.5  # norm="dyt" or "derf": the initial alpha of every DyT or Derf (Zhu et al. 2025's default)
    # in training, shift every norm's input row by N(0, (this * the row's RMS)^2), one draw per row (invariance preset)
    norm_shift_noise: float = 0.0
    placement: str = "pre"  # post, pre, sandwich or deepnorm
    final_norm: bool | None = None  # a norm before the LM head; None: the placement's default
    embed_norm: bool = False  # a norm (the model's kind) on the embeddings before the first block (Bloom's)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3, OLMo 2)
    ln_scaling: bool = False  # pre only: layer l's norms' outputs times 1/sqrt(l) (Sun et al. 2025's LayerNorm Scaling)
    deepnorm_alpha: float | None = None  # residual scale; None: (2 L)^(1/4)
    deepnorm_beta: float | None = None  # init gain; None: (8 L)^(-1/4)
    deepnorm_init: str = "deepnet"  # "deepnet" (xavier, gain beta) or "article" (xavier / sqrt(L), / sqrt(2L))
    backend: str | None = None  # normlab backend for the norms; None: auto
    norm_impl: str = "normlab"  # "torch": torch.nn.LayerNorm / nn.RMSNorm instead (speed comparisons)
    init_std: float = 0.02  # std of the normal init (not used by deepnorm's xavier groups)
    init: str = "gpt2"  # block weights: "gpt2" (N(0, init_std), output projections / sqrt(2 L)) or "xavier" (Xiong et al., DeepNet baselines)

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
                raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0{note}, got {value!r}")

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
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); change one of them")
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim = d_model / n_heads = {self.d_model // self.n_heads} must be even for rotary embeddings")
        if self.n_kv_heads is not None and (isinstance(self.n_kv_heads, bool) or not isinstance(self.n_kv_heads, int)
                                            or self.n_kv_heads < 1):
            raise ValueError(f"n_kv_heads must be a positive int or None (None: n_heads), got {self.n_kv_heads!r}")
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})")
        if self.norm_partial is not None:
            if self.norm != "prmsnorm":
                raise ValueError(f"norm_partial is set ({self.norm_partial}) but norm is {self.norm!r}; use norm='prmsnorm' or drop norm_partial")
            if not 0 < self.norm_partial <= 1:
                raise ValueError(f"norm_partial must be in (0, 1], got {self.norm_partial}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
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
        for name in ("embed_norm", "qk_norm", "ln_scaling", "norm_weightless", "embed_scale", "tie_embeddings"):
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
            raise ValueError("norm_weightless: norm='scalenorm' has one scalar gain and no per-feature weights to drop")
        if self.norm_impl == "torch" and self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm_impl='torch' exists for layernorm and rmsnorm only, not {self.norm!r}")
        if self.d_ff is not None and (isinstance(self.d_ff, bool) or not isinstance(self.d_ff, int) or self.d_ff < 1):
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
        opts: dict = {"eps": self.norm_eps} if self.norm not in ("dyt", "derf") else {"alpha0": self.dyt_alpha0}
        if self.norm in ("rmsnorm", "prmsnorm"):
            opts.update(cast=self.norm_cast, eps_mode=self.norm_eps_mode)
            if self.norm == "prmsnorm" and self.norm_partial is not None:
                opts["partial"] = self.norm_partial
        if self.norm in ("layernorm", "rmsnorm", "prmsnorm", "l2", "scalenorm", "dyt", "derf") and self.backend is not None:
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


# ----------------------------------------------------------------------------------- layers


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos and sin, (seq_len, head_dim), for rotating pairs (i, i + head_dim / 2) (Llama/HF)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def sinusoid_table(seq_len: int, d: int) -> Tensor:
    """The original Transformer's positions: sin and cos of position / 10000^(2i/d), (seq_len, d)."""
    pos = torch.arange(seq_len, dtype=torch.float32)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    table = torch.zeros(seq_len, d)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : d // 2]
    return table


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x (B, H, T, hd); cos, sin (T, hd)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = build_norm("rmsnorm", cfg.head_dim, eps=cfg.norm_eps, backend=cfg.backend)
            self.k_norm = build_norm("rmsnorm", cfg.head_dim, eps=cfg.norm_eps, backend=cfg.backend)
        self.dropout = cfg.dropout
        self.rope = cfg.positions == "rope"
        self.record_logits = False  # diagnostics: keep the largest attention logit of the next forward
        self.max_logit: Tensor | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | None, cache: dict | None) -> Tensor:
        B, T, _ = x.shape  # (B, T, d)
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # generation: append to and attend over the cached keys/values
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        if self.kv_heads != self.n_heads:
            rep = self.n_heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.record_logits:  # the logits SDPA computes inside, over the keys each query may see
            logits = (q @ k.transpose(-2, -1)).float() * self.head_dim**-0.5
            seen = attn_mask if attn_mask is not None else torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).tril(
                k.shape[2] - q.shape[2])
            self.max_logit = logits.masked_fill(~seen, float("-inf")).amax().detach()
        p = self.dropout if self.training else 0.0
        if attn_mask is None:
            y = TF.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=T > 1 and k.shape[2] == T)
        else:
            y = TF.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GELU: down(gelu(up(x))); ReLU: down(relu(up(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        self.up = nn.Linear(cfg.d_model, cfg.ff_dim, bias=False)
        self.gate = nn.Linear(cfg.d_model, cfg.ff_dim, bias=False) if cfg.mlp == "swiglu" else None
        self.down = nn.Linear(cfg.ff_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:
            return self.down(TF.silu(self.gate(x)) * self.up(x))
        if self.kind == "relu":
            return self.down(TF.relu(self.up(x)))
        return self.down(TF.gelu(self.up(x)))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The norm the config asks for, over d_model."""
    if cfg.norm_impl == "torch":
        affine = not cfg.norm_weightless
        if cfg.norm == "layernorm":
            norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, elementwise_affine=affine)
        else:
            norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps, elementwise_affine=affine)
    else:
        norm = build_norm(cfg.norm, cfg.d_model, **cfg.norm_options())
    if cfg.norm_shift_noise:
        norm.shift_noise = cfg.norm_shift_noise  # a plain attribute: state_dict keys stay
    return norm


def _norm(module: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """Call a norm; only sequence BatchNorm takes the padding mask. In training, a norm with a
    ``shift_noise`` gets each input row shifted by a random constant (re-centering noise) whose std
    is that fraction of the row's own RMS, so the noise keeps its size relative to the stream."""
    noise = getattr(module, "shift_noise", 0.0)
    if noise and module.training:
        rms = x.detach().float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)  # (..., 1)
        x = x + noise * rms * torch.randn(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
    if isinstance(module, SequenceBatchNorm):
        return module(x, mask)
    return module(x)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 1) -> None:
        super().__init__()
        self.placement = cfg.placement
        self.alpha = cfg.alpha if cfg.placement == "deepnorm" else 1.0
        # LayerNorm Scaling (Sun et al. 2025): damp what deep layers' norms feed their branches, so
        # that the residual stream's variance stops growing with depth
        self.norm_scale = layer ** -0.5 if cfg.ln_scaling else 1.0
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.attn_norm, self.mlp_norm = make_norm(cfg), make_norm(cfg)
        # sandwich only: the norm on each branch's output
        self.attn_out_norm = make_norm(cfg) if cfg.placement == "sandwich" else None
        self.mlp_out_norm = make_norm(cfg) if cfg.placement == "sandwich" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.record_rms = False  # diagnostics: keep the RMS of the residual stream this block emits
        self.rms: Tensor | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, attn_mask: Tensor | None,
                cache: dict | None = None) -> Tensor:
        attn = lambda h: self.drop(self.attn(h, cos, sin, attn_mask, cache))  # noqa: E731
        mlp = lambda h: self.drop(self.mlp(h))  # noqa: E731
        if self.placement == "post":
            x = _norm(self.attn_norm, x + attn(x), mask)
            x = _norm(self.mlp_norm, x + mlp(x), mask)
        elif self.placement == "pre" and self.norm_scale != 1.0:
            x = x + attn(_norm(self.attn_norm, x, mask) * self.norm_scale)
            x = x + mlp(_norm(self.mlp_norm, x, mask) * self.norm_scale)
        elif self.placement == "pre":
            x = x + attn(_norm(self.attn_norm, x, mask))
            x = x + mlp(_norm(self.mlp_norm, x, mask))
        elif self.placement == "sandwich":
            x = x + _norm(self.attn_out_norm, attn(_norm(self.attn_norm, x, mask)), mask)
            x = x + _norm(self.mlp_out_norm, mlp(_norm(self.mlp_norm, x, mask)), mask)
        else:  # deepnorm
            x = _norm(self.attn_norm, self.alpha * x + attn(x), mask)
            x = _norm(self.mlp_norm, self.alpha * x + mlp(x), mask)
        if self.record_rms:
            self.rms = x.detach().float().pow(2).mean().sqrt()
        return x


# ------------------------------------------------------------------------------------ model


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_gain = nn.Parameter(torch.empty(())) if cfg.embed_gain is not None else None
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" else None
        if cfg.positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoid_table(cfg.max_seq_len, cfg.d_model), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.embed_norm = make_norm(cfg) if cfg.embed_norm else None
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(1, cfg.n_layers + 1))
        self.final_norm = make_norm(cfg) if cfg.has_final_norm else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_rms: Tensor | None = None  # diagnostics: see record_activations
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    # ------------------------------------------------------------------ initialization

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.cfg
        for module in self.modules():  # norms keep their own init (scale 1, bias 0)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, cfg.init_std)
        if self.embed_gain is not None:
            self.embed_gain.fill_(cfg.embed_gain)
        if cfg.embed_scale:  # times sqrt(d) in forward: unit variance on the residual stream
            nn.init.normal_(self.embed.weight, 0.0, cfg.d_model**-0.5)
        for block in self.blocks:
            if cfg.placement == "deepnorm":
                self._deepnorm_init(block)
            elif cfg.init == "xavier":  # the original Transformer's: every block matrix xavier, no depth scaling
                for module in block.modules():
                    if isinstance(module, nn.Linear):
                        nn.init.xavier_normal_(module.weight)
            else:  # GPT-2's scaled init of the projections that write into the residual stream
                for proj in (block.attn.wo, block.mlp.down):
                    nn.init.normal_(proj.weight, 0.0, cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def _deepnorm_init(self, block: Block) -> None:
        beta = self.cfg.beta
        attn, mlp = block.attn, block.mlp
        if self.cfg.deepnorm_init == "article":
            L = self.cfg.n_layers
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    nn.init.xavier_normal_(module.weight)
            for proj in (mlp.up, mlp.down) + ((mlp.gate,) if mlp.gate is not None else ()):
                proj.weight.div_(math.sqrt(L))
            for proj in (attn.wv, attn.wo):
                proj.weight.div_(math.sqrt(2 * L))
            return
        for proj in (attn.wq, attn.wk):
            nn.init.xavier_normal_(proj.weight, gain=1.0)
        for proj in (attn.wv, attn.wo, mlp.up, mlp.down) + ((mlp.gate,) if mlp.gate is not None else ()):
            nn.init.xavier_normal_(proj.weight, gain=beta)

    # ------------------------------------------------------------------------- forward

    def _attn_mask(self, mask: Tensor | None, T: int, past: int) -> Tensor | None:
        """Boolean (B, 1, T, past + T): causal, and only real keys; a query always sees itself,
        so an all-padding row gives finite (ignored) outputs instead of nan."""
        if mask is None:
            return None
        keys = mask if mask.shape[1] == past + T else TF.pad(mask, (past + T - mask.shape[1], 0), value=True)
        q_pos = torch.arange(past, past + T, device=mask.device)[:, None]
        k_pos = torch.arange(past + T, device=mask.device)[None, :]
        causal = k_pos <= q_pos  # (T, S)
        allowed = causal[None] & keys[:, None, :]
        allowed = allowed | (k_pos == q_pos)[None]
        return allowed[:, None]

    def forward(self, idx: Tensor, targets: Tensor | None = None, mask: Tensor | None = None,
                caches: list[dict] | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits (B, T, vocab) and, with ``targets``, the mean cross-entropy over real tokens.

        ``mask`` (B, T) bool: True at real tokens; padding is excluded from the loss, from
        attention keys, and from sequence BatchNorm's statistics. ``caches``: one dict per
        layer for incremental decoding (see :meth:`generate`).
        """
        B, T = idx.shape
        past = caches[0]["k"].shape[2] if caches and "k" in caches[0] else 0
        if past + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {past + T} tokens is longer than max_seq_len={self.cfg.max_seq_len}")
        if mask is not None and mask.shape != (B, T):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(B, T)} (that of idx)")
        cos, sin = self.rope_cos[past : past + T], self.rope_sin[past : past + T]
        attn_mask = self._attn_mask(mask, T, past)
        x = self.embed(idx)
        if self.cfg.embed_scale:
            x = x * math.sqrt(self.cfg.d_model)
        elif self.embed_gain is not None:
            x = x * self.embed_gain
        if self.pos_embed is not None:
            x = x + self.pos_embed.weight[past : past + T]
        elif self.cfg.positions == "sinusoidal":
            x = x + self.pos_table[past : past + T]
        if self.embed_norm is not None:
            x = _norm(self.embed_norm, x, mask)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask, attn_mask, caches[i] if caches is not None else None)
        if self.final_norm is not None:
            x = _norm(self.final_norm, x, mask)
        if self.blocks[0].record_rms:
            self.head_rms = x.detach().float().pow(2).mean().sqrt()
        logits = self.head(x)
        loss = None
        if targets is not None:
            if mask is not None:
                targets = targets.masked_fill(~mask, -100)
            loss = TF.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T) with a KV cache; temperature 0 is
        greedy. The prompt is processed once, then one token per step."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be at least 1, or None for no cut, got {top_k}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}) (the vocabulary), got ids from "
                             f"{int(idx.min())} to {int(idx.max())}")
        if idx.shape[1] + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt ({idx.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len={self.cfg.max_seq_len}")
        was_training = self.training
        self.eval()
        caches: list[dict] = [{} for _ in self.blocks]
        step = idx
        out = idx
        for _ in range(max_new_tokens):
            logits, _ = self(step, caches=caches)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            out = torch.cat([out, nxt], dim=1)
            step = nxt
        self.train(was_training)
        return out

    # --------------------------------------------------------------------- diagnostics

    def num_parameters(self, embeddings: bool = True) -> int:
        """Parameter count (tied weights once); ``embeddings=False`` leaves out the token
        embedding (and an untied LM head)."""
        n = sum(p.numel() for p in self.parameters())
        if not embeddings:
            n -= self.embed.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.head.weight.numel()
        return n

    def record_activations(self, enabled: bool = True) -> None:
        """Keep each block's output RMS (the residual stream), and that of the LM head's input,
        on the next forwards."""
        for block in self.blocks:
            block.record_rms = enabled
            block.rms = None
        self.head_rms = None

    def head_input_rms(self) -> float:
        """RMS of what the LM head read in the last forward (the final norm's output, or without
        one the residual stream itself; see :meth:`record_activations`)."""
        return float(self.head_rms) if getattr(self, "head_rms", None) is not None else float("nan")

    def record_attention_logits(self, enabled: bool = True) -> None:
        """Keep each layer's largest attention logit (q.k / sqrt(head_dim)) on the next forwards."""
        for block in self.blocks:
            block.attn.record_logits = enabled
            block.attn.max_logit = None

    def attention_logits(self) -> list[float]:
        """Per layer, the largest attention logit of the last forward (see
        :meth:`record_attention_logits`): its growth is the high-learning-rate instability that
        qk-norm prevents (Dehghani et al. 2023, Wortsman et al. 2023)."""
        return [float(b.attn.max_logit) if b.attn.max_logit is not None else float("nan") for b in self.blocks]

    def activation_rms(self) -> list[float]:
        """RMS of the residual stream after each block, from the last forward (see
        :meth:`record_activations`)."""
        return [float(b.rms) if b.rms is not None else float("nan") for b in self.blocks]

    def grad_norms(self) -> list[dict[str, float]]:
        """Per layer: gradient norms of the attention and MLP sublayers (all their weights), and
        of their output projections alone (``attn_out``: wo, ``mlp_out``: the MLP's down
        projection, the quantity of Xiong et al.'s Fig. 3). Reads ``.grad``: call after backward."""

        def norm(params) -> float:
            grads = [p.grad.detach().float() for p in params if p.grad is not None]
            return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0

        out = []
        for block in self.blocks:
            out.append({
                "attn": norm(block.attn.parameters()),
                "mlp": norm(block.mlp.parameters()),
                "attn_out": norm([block.attn.wo.weight]),
                "mlp_out": norm([block.mlp.down.weight]),
            })
        return out
