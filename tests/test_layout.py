"""The house's shape: imports run down the layers (the math, the kernels, the layers, the model,
training, the lab, the report, the command), no preset imports another preset, and no
module outgrows 600 lines or 110 columns."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "normlab"

# Lowest first. A module may import from its own layer or a lower one.
LAYERS = [
    {"reference", "testing", "runs", "intervals", "claims", "plots", "env", "bench_tables",
     "experiments.cost", "experiments.design", "kernels.triton.kernels",
     "kernels.cpu.codecs", "kernels.cpu.pointwise", "kernels.cpu.tanh_erf", "kernels.cpu.layernorm",
     "kernels.cpu.layernorm_bwd",
     "kernels.cpu.memory", "kernels.cpu.rmsnorm",
     "kernels.cpu.rows", "kernels.cpu.simd"},
    {"kernels.ops", "kernels.cpu.cache", "kernels.cpu.launch", "kernels.triton.launch"},
    {"kernels.dispatch"},
    {"kernels", "kernels.triton", "kernels.cpu"},
    {"functional"},
    {"torch_compat"},
    {"nn"},
    {"model_config"},
    {"model", "rnn", "footprint"},
    {"data", "bench", "hf.patching"},
    {"hf.checking", "hf.census", "hf"},
    {"train_config", "train"},
    {"experiments.ladder", "experiments.timing", "experiments.lab", "experiments.sweep"},
    {"experiments.common"},
    set(),  # the presets (filled below)
    {"experiments", "report", "ladder_report"},
    {"compare"},
    {"commands"},
    {"cli", "", "__main__"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


def _imports(path: Path, modules: dict) -> set[str]:
    """The normlab modules a file imports (``from normlab.x import y`` is y when y is a module)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.startswith("normlab")
        ):
            base = node.module.removeprefix("normlab").lstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}".lstrip(".")
                deps.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            deps |= {a.name.removeprefix("normlab").lstrip(".") for a in node.names
                     if a.name.startswith("normlab")}
    return deps


def _presets(modules: dict) -> set[str]:
    return {m for m, p in modules.items() if m.startswith("experiments.") and "def preset_" in p.read_text()}


def test_no_preset_imports_another_preset():
    modules = _modules()
    presets = _presets(modules)
    assert len(presets) >= 10
    bad = {(p, d) for p in presets for d in _imports(modules[p], modules) if d in presets - {p}}
    assert not bad, (f"presets that import another preset: {sorted(bad)} "
                     "(shared things go in experiments/common.py)")


def test_imports_run_down_the_layers():
    modules = _modules()
    layers = [set(layer) for layer in LAYERS]
    layers[LAYERS.index(set())] = _presets(modules)
    rank = {m: i for i, layer in enumerate(layers) for m in layer}
    assert set(modules) <= set(rank), f"modules without a layer: {sorted(set(modules) - set(rank))}"
    upward = {(m, d) for m in modules for d in _imports(modules[m], modules)
              if d != m and d in rank and rank[d] > rank[m]}
    assert not upward, f"imports from a higher layer: {sorted(upward)}"


def test_ruff_finds_nothing():
    """pyflakes' checks (unused imports, undefined names, redefinitions) and the 110-column limit
    over the whole tree, by ruff with the pyproject's rules."""
    root = SRC.parents[1]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "src", "tests", "tools", "benchmarks"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_source_file_holds_under_600_lines():
    """STYLE.md's complexity budget: a module that outgrows it holds two ideas; split it."""
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n >= 600}
    assert not long, f"modules of 600 lines or more: {long}"


def _private_uses(path: Path) -> set[str]:
    """Underscore names a file takes from another normlab module: imported by name, or read as an
    attribute of a normlab module it imported (``from normlab.kernels.cpu import memory``)."""
    tree = ast.parse(path.read_text())
    aliases, found = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("normlab")):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.add(f"{node.module}.{a.name}")
                aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name.startswith("normlab") and a.asname}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.add(f"{node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    """A name other files use is public (no underscore), so a reader can tell a module's interface
    from its internals."""
    bad = {f"{m}: {', '.join(sorted(u))}" for m, p in _modules().items() if (u := _private_uses(p))}
    assert not bad, f"private names used across modules: {sorted(bad)}"
