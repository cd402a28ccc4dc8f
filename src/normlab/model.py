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

import math

import torch
import torch.nn.functional as TF
from torch import Tensor, nn

from normlab.model_config import ModelConfig  # also read as normlab.model.ModelConfig
from normlab.nn import SequenceBatchNorm, build_norm

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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | None,
                cache: dict | None) -> Tensor:
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
            seen = attn_mask
            if seen is None:
                seen = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device)
                seen = seen.tril(k.shape[2] - q.shape[2])
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
            # the original Transformer's: every block matrix xavier, no depth scaling
            elif cfg.init == "xavier":
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
            raise ValueError(f"sequence of {past + T} tokens is longer than "
                             f"max_seq_len={self.cfg.max_seq_len}")
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
            loss = TF.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                                    ignore_index=-100)
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
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}) (the vocabulary), got ids "
                             f"from {int(idx.min())} to {int(idx.max())}")
        if idx.shape[1] + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt ({idx.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={self.cfg.max_seq_len}")
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
        return [float(b.attn.max_logit) if b.attn.max_logit is not None else float("nan")
                for b in self.blocks]

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
