"""torch.compile and torch.export over the CPU backend's custom ops: a fullgraph stack matches eager,
with dynamic shapes too, and an exported one saved and loaded keeps the ops and their gradients."""

import pytest
import torch

from normlab import functional as F

pytest.importorskip("numba", reason="the cpu backend needs numba (pip install normlab[cpu])")


class _Block(torch.nn.Module):
    """A small decoder-style stack of normlab norms around linear layers."""

    def __init__(self, d):
        super().__init__()
        import normlab

        self.n1 = normlab.RMSNorm(d)
        self.n2 = normlab.LayerNorm(d)
        self.n3 = normlab.RMSNorm(d, cast="gemma", offset=1.0, partial=0.25)
        self.f1 = torch.nn.Linear(d, d)
        self.f2 = torch.nn.Linear(d, d)

    def forward(self, x):
        h = x + self.f1(self.n1(x))
        y, h = F.add_rms_norm(self.f2(self.n2(h)), h, self.n1.weight)
        y2, h = F.add_layer_norm(y, h, self.n2.weight, self.n2.bias)
        return self.n3(h + y2)


def test_compiled_stack_matches_eager_with_no_graph_break(gen):
    torch.manual_seed(gen.initial_seed() % 2**31)
    m = _Block(32)
    x = torch.randn(2, 5, 32, generator=gen, requires_grad=True)
    eager = m(x)
    (gx_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert torch.allclose(out, eager, atol=1e-6) and torch.allclose(gx, gx_eager, atol=1e-6)
    explain = torch._dynamo.explain(m)(x)
    assert explain.graph_break_count == 0
    ops = {str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("normlab.cpu_rms_norm" in o for o in ops), ops


def test_compiles_fullgraph_with_dynamic_shapes(gen):
    """dynamic=True makes float attributes such as eps symbolic; the argument checks must not
    graph-break on them, and the rows may change without a recompile per shape."""
    torch.manual_seed(gen.initial_seed() % 2**31)
    m = _Block(32)
    compiled = torch.compile(m, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 7):
        x = torch.randn(2, rows, 32, generator=gen)
        assert torch.allclose(compiled(x), m(x), atol=1e-6)


def test_an_exported_stack_saved_and_loaded_gives_eagers_bits_and_gradients(gen, tmp_path):
    """torch.export, the deployment path: the graph holds normlab's ops (not a decomposition into
    slower aten math), survives torch.export.save / load, and runs other batch and row counts."""
    torch.manual_seed(gen.initial_seed() % 2**31)
    m = _Block(32)
    x = torch.randn(2, 5, 32, generator=gen)
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("rows")}
    torch.export.save(torch.export.export(m, (x,), dynamic_shapes=(dims,)), tmp_path / "block.pt2")
    program = torch.export.load(tmp_path / "block.pt2")
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"normlab.cpu_rms_norm.default", "normlab.cpu_add_layer_norm.default"} <= ops, ops
    loaded = program.module()
    for shape in ((2, 5, 32), (3, 9, 32)):
        x = torch.randn(*shape, generator=gen, requires_grad=True)
        dy = torch.randn(*shape, generator=gen)
        eager, exported = m(x), loaded(x)
        assert torch.equal(exported, eager)
        want = torch.autograd.grad((eager * dy).sum(), [x, m.n1.weight, m.n2.bias])
        got = torch.autograd.grad((exported * dy).sum(), [x, loaded.n1.weight, loaded.n2.bias])
        assert all(torch.equal(a, b) for a, b in zip(got, want))
