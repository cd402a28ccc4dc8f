"""bench_tables: the tables made from bench records."""

from normlab import bench_tables


def test_summary_rows_compare_with_normlab():
    rows = bench_tables.summary_rows([
        {"op": "rms_norm", "backend": "normlab", "dtype": "fp32", "shape": "1x1", "pass": "fwd",
         "alloc": "alloc", "ms": 2.0},
        {"op": "rms_norm", "backend": "torch", "dtype": "fp32", "shape": "1x1", "pass": "fwd",
         "alloc": "alloc", "ms": 6.0},
    ])
    assert [r["x_normlab"] for r in rows] == [1.0, 3.0]


def test_rms_vs_layer_pairs_the_same_case_of_both_norms():
    def rec(op, ms, backend="normlab", alloc="alloc", shape="8x8"):
        return {"op": op, "backend": backend, "dtype": "bf16", "shape": shape, "pass": "fwd", "alloc": alloc,
                "ms": ms}

    rows = bench_tables.rms_vs_layer([
        rec("rms_norm", 3.0), rec("layer_norm", 4.0), rec("rms_norm", 1.0, backend="torch"),
        rec("layer_norm", 9.0, backend="torch"),
        rec("rms_norm", 2.0, alloc="prealloc"), rec("add_rms_norm", 5.0), rec("add_layer_norm", 4.0),
        rec("rms_norm", 7.0, shape="2x2"), rec("layer_norm", 7.0, shape="4x4"),
    ])
    got = {(r["op"], r["alloc"], r["shape"]): r["ratio"] for r in rows}
    assert got == {("rms_norm", "alloc", "8x8"): 0.75, ("add_rms_norm", "alloc", "8x8"): 1.25}
