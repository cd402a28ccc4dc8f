"""Patching a Hugging Face transformers model: swap each normalization module for normlab's fused
op with that family's exact numerics.

    report = normlab.hf.patch(model)            # every norm it knows; report lists what and why not
    normlab.hf.unpatch(model)                   # the original forwards again

Patching replaces a module instance's ``forward`` (never its class, parameters or buffers), so
state_dict keys stay the same and PEFT/LoRA wrappers, already-loaded models and models you
subclassed keep working. Each family's numerics (DESIGN.md):

| classes | normlab op |
|---|---|
| LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm (also q_norm/k_norm over head_dim), GlmRMSNorm, Glm4RMSNorm, DeepseekV3RMSNorm (also MLA's q_a/kv_a norms) | rms_norm, cast="llama" |
| GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm | rms_norm, cast="gemma", offset=1 (weights store w, apply 1 + w) |
| Olmo2RMSNorm | rms_norm, cast="gemma" (weight times fp32 xhat, cast last) |
| T5LayerNorm | rms_norm, cast="llama" (no mean, no bias) |
| torch.nn.LayerNorm (GPT-2, BERT with eps 1e-12, Bloom with its embedding LayerNorm, Falcon, ...) | layer_norm |
| torch.nn.RMSNorm | rms_norm, cast="gemma" (eps None: fp32's machine epsilon, as torch uses for fp32/bf16/fp16) |

Before a module is patched, the normlab op and the original forward run on the same small random
input (the module's own weights, in its dtype) and must agree to within the error bound;
a module whose class is unknown, or whose numerics do not match, is left alone and reported
with the reason. At call time an input the fused op does not cover exactly (a dtype different
from the weight's, as under autocast) goes to the original forward.

``fuse_residual=True`` additionally rewrites Llama-family decoder layers (Llama, Mistral, Qwen2,
Qwen3, Gemma) so that the attention residual add and post_attention_layernorm run as one fused
add_rms_norm; the results are the same (the sum is rounded to the residual's dtype either way).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from normlab import functional as F

# class name -> (op, cast, offset, name of the eps attribute)
RMS_CLASSES = {
    **{name: ("rms", "llama", 0.0, "variance_epsilon") for name in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                                                                    "GlmRMSNorm", "Glm4RMSNorm", "DeepseekV3RMSNorm")},
    **{name: ("rms", "gemma", 1.0, "eps") for name in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")},
    "Olmo2RMSNorm": ("rms", "gemma", 0.0, "variance_epsilon"),
    "T5LayerNorm": ("rms", "llama", 0.0, "variance_epsilon"),
}
# Decoder layers whose forward is Llama's (attention residual add, then post_attention_layernorm).
FUSABLE_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "GemmaDecoderLayer")


@dataclass
class PatchReport:
    patched: list[tuple[str, str, str]] = field(default_factory=list)  # (module name, class, mode)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (module name, class, reason)
    fused: list[str] = field(default_factory=list)  # decoder layers with fused residual add + norm

    def __str__(self) -> str:
        lines = [f"patched {len(self.patched)} norm modules, left {len(self.skipped)} alone, fused {len(self.fused)} layers"]
        lines += [f"  patched  {n} ({c}): {m}" for n, c, m in self.patched]
        lines += [f"  skipped  {n} ({c}): {r}" for n, c, r in self.skipped]
        return "\n".join(lines)


def norm_spec(module: nn.Module) -> tuple[dict | None, str]:
    """normlab options that reproduce ``module``, or None and the reason."""
    cls = type(module)
    name = cls.__name__
    if name in RMS_CLASSES:
        _, cast, offset, eps_attr = RMS_CLASSES[name]
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            return None, "no weight tensor"
        return {"op": "rms", "cast": cast, "offset": offset, "eps": float(getattr(module, eps_attr))}, ""
    if isinstance(module, nn.LayerNorm):
        if cls.forward is not nn.LayerNorm.forward:
            return None, "a LayerNorm subclass with its own forward"
        if len(module.normalized_shape) != 1:
            return None, f"normalized_shape {tuple(module.normalized_shape)} spans more than the last dimension"
        return {"op": "ln", "eps": float(module.eps)}, ""
    if isinstance(module, nn.RMSNorm):
        if cls.forward is not nn.RMSNorm.forward:
            return None, "an RMSNorm subclass with its own forward"
        if len(module.normalized_shape) != 1:
            return None, f"normalized_shape {tuple(module.normalized_shape)} spans more than the last dimension"
        return {"op": "rms", "cast": "gemma", "offset": 0.0, "eps": module.eps}, ""
    if "norm" in name.lower():
        return None, "unknown norm class"
    return None, ""


def _make_forward(spec: dict, backend: str | None):
    op = spec["op"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        b = getattr(self, "bias", None) if op == "ln" else None
        if (w is not None and w.dtype != x.dtype) or (b is not None and b.dtype != x.dtype) or x.dtype == torch.float64:
            return self._normlab_original(x)  # mixed dtypes: the original's promotion rules apply
        if op == "ln":
            return F.layer_norm(x, w, b, eps=spec["eps"], backend=backend)
        # eps None: torch takes the machine epsilon of the dtype it computes in (fp32 for fp16/bf16/fp32)
        eps = spec["eps"] if spec["eps"] is not None else torch.finfo(torch.float32).eps
        return F.rms_norm(x, w, eps, cast=spec["cast"], offset=spec["offset"], backend=backend)

    forward.spec = spec
    return forward


@torch.no_grad()
def _matches(module: nn.Module, forward, gen: torch.Generator) -> str:
    """'' when normlab's forward agrees with the original on a random input, else why not."""
    w = module.weight if isinstance(getattr(module, "weight", None), torch.Tensor) else None
    dtype = w.dtype if w is not None else torch.float32
    d = w.shape[-1] if w is not None else module.normalized_shape[-1]
    device = w.device if w is not None else torch.device("cpu")
    if device.type == "meta":
        return "weights on the meta device"
    x64 = torch.randn(64, d, generator=gen, dtype=torch.float64) * 2 + 0.5
    x = x64.to(device=device, dtype=dtype)
    try:
        ours = forward(module, x)
        theirs = module._normlab_original(x)
    except Exception as err:  # an option normlab's op refuses
        return f"normlab cannot run it ({type(err).__name__}: {err})"
    if x.dtype == torch.float64:  # float64 goes to the original at call time: nothing to compare
        return ""
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return f"output {theirs.dtype} {tuple(theirs.shape)} differs from normlab's {ours.dtype} {tuple(ours.shape)}"
    # fp32: within 1e-5 relative. bf16/fp16: within 2 ulps, and (the same cast order rounds the same
    # way) at most 5% of the elements differ at all; the other cast order moves about a third.
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    diff = (ours.float() - theirs.float()).abs()
    if not bool((diff <= tol * (theirs.float().abs() + 1)).all()):
        return f"numerics differ from normlab's {_mode_text(forward.spec)} (largest difference {diff.max().item():.3g})"
    if dtype in (torch.bfloat16, torch.float16) and (diff > 0).float().mean().item() > 0.05:
        return f"rounding differs from normlab's {_mode_text(forward.spec)} ({(diff > 0).float().mean().item():.0%} of elements)"
    return ""


def patch(model: nn.Module, *, backend: str = "auto", fuse_residual: bool = False) -> PatchReport:
    """Swap every normalization module of ``model`` it knows for normlab's fused op (in place)."""
    F.check_choice(backend, "backend", ("auto", "reference", "cpu", "triton"))
    be = None if backend == "auto" else backend
    report = PatchReport()
    gen = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        spec, reason = norm_spec(module)
        if spec is None:
            if reason:
                report.skipped.append((name, type(module).__name__, reason))
            continue
        if hasattr(module, "_normlab_original"):
            report.patched.append((name, type(module).__name__, module._normlab_mode))
            continue
        forward = _make_forward(spec, be)
        module._normlab_previous = module.__dict__.get("forward")  # someone else's instance-level forward, if any
        module._normlab_original = module.forward
        why = _matches(module, forward, gen)
        if why:
            del module._normlab_original, module._normlab_previous
            report.skipped.append((name, type(module).__name__, why))
            continue
        module.forward = types.MethodType(forward, module)
        module._normlab_mode = _mode_text(spec)
        module._normlab_spec = spec
        report.patched.append((name, type(module).__name__, module._normlab_mode))
    if fuse_residual:
        for name, layer in model.named_modules():
            if type(layer).__name__ in FUSABLE_LAYERS and hasattr(getattr(layer, "post_attention_layernorm", None), "_normlab_spec"):
                if not hasattr(layer, "_normlab_original"):
                    layer._normlab_previous = layer.__dict__.get("forward")
                    layer._normlab_original = layer.forward
                    layer.forward = types.MethodType(_fused_layer_forward(be), layer)
                report.fused.append(name)
    return report


def _mode_text(spec: dict) -> str:
    if spec["op"] == "ln":
        return f"layer_norm eps={spec['eps']:g}"
    eps = "fp32 eps" if spec["eps"] is None else f"{spec['eps']:g}"
    return f"rms_norm cast={spec['cast']} offset={spec['offset']:g} eps={eps}"


def _fused_layer_forward(backend):
    def forward(self, hidden_states, *args, **kwargs):
        if args:  # called positionally beyond hidden_states: not the call this rewrite knows
            return self._normlab_original(hidden_states, *args, **kwargs)
        norm = self.post_attention_layernorm
        spec = norm._normlab_spec
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # the caller's keywords go to attention as the original layer passes them (no defaults added:
        # transformers renames them between releases)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        if hidden_states.dtype == residual.dtype == norm.weight.dtype and hidden_states.dtype != torch.float64:
            # one pass: s = residual + attn_out (rounded to the residual's dtype, as the unfused add is), y = norm(s)
            hidden_states, residual = F.add_rms_norm(hidden_states, residual, norm.weight, spec["eps"], cast=spec["cast"],
                                                     offset=spec["offset"], backend=backend)
        else:
            residual = residual + hidden_states
            hidden_states = norm(residual)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states

    return forward


def unpatch(model: nn.Module) -> int:
    """Restore every original forward ``patch`` replaced; returns how many modules it restored."""
    n = 0
    for module in model.modules():
        if hasattr(module, "_normlab_original"):
            previous = module.__dict__.get("_normlab_previous")
            module.__dict__.pop("forward", None)
            if previous is not None:
                module.forward = previous
            for attr in ("_normlab_original", "_normlab_previous", "_normlab_mode", "_normlab_spec"):
                module.__dict__.pop(attr, None)
            n += 1
    return n
