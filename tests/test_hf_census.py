"""The census of transformers' norms (normlab check-model --census) on a handful of model types:
each norm class is found, patched in the flavor its family computes or left alone with the reason,
and the table and counts are written."""

import json

import pytest

pytest.importorskip("transformers")

from normlab.cli import main  # noqa: E402
from normlab.hf import census as C  # noqa: E402


def test_shrink_cuts_depth_experts_and_per_layer_lists():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=24, num_experts=64, layer_types=["full_attention"] * 24)
    changed = C.shrink(config)
    assert (
        config.num_hidden_layers == 2
        and config.num_experts == 4
        and config.layer_types == ["full_attention"] * 2
    )
    # its name for num_experts
    assert "num_hidden_layers 24->2" in changed and "num_local_experts 64->4" in changed


def test_census_rows_say_what_patch_does_with_each_norm(tmp_path):
    every = C.model_types()  # surveyed here, in this process (the CLI test runs the process pool)
    rows = [C.survey(t, every[t]) for t in ("llama", "gemma3", "convnext", "mamba2", "align_text_model")]
    by_type = {r["model_type"]: r for r in rows}
    verdicts = {t: {(n["norm"], n["verdict"]) for n in r["norms"]} for t, r in by_type.items()}
    assert ("LlamaRMSNorm", "rms_norm cast=llama offset=0 eps=1e-06") in verdicts["llama"]
    assert ("Gemma3RMSNorm", "rms_norm cast=gemma offset=1 eps=1e-06") in verdicts["gemma3"]
    convnext = {v for n, v in verdicts["convnext"] if n == "ConvNextLayerNorm"}
    assert "layer_norm eps=1e-06" in convnext  # channels last: over the features
    assert any(v.startswith("its forward fails on one") for v in convnext)  # channels first: over dimension 1
    # # the gated norm (MambaRMSNormGated in transformers 5.24, Mamba2RMSNormGated from 5.25) normalizes in
    # groups
    assert any(n.endswith("RMSNormGated") and "no normlab flavor agrees" in v for n, v in verdicts["mamba2"])
    assert by_type["align_text_model"]["class"] == "AlignTextModel" and by_type["align_text_model"]["norms"]

    paths = C.write(rows, tmp_path, {"transformers": "x"})
    saved = json.loads(paths["json"].read_text())
    assert saved["summary"]["model_types"] == 5 and saved["summary"]["built"] == 5
    assert saved["summary"]["modules"] == sum(n["count"] for r in rows for n in r["norms"])
    table = paths["md"].read_text()
    assert "| llama | LlamaModel | LlamaRMSNorm x" in table and "Of 5 model types, 5 build" in table


def test_cli_census_and_unknown_types(tmp_path, capsys):
    args = ["check-model", "--census", "--run", "--types", "bert", "--jobs", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Of 1 model types, 1 build" in out
    assert "Run whole: 1 of the 1 model types with a patched norm, 1 within" in " ".join(out.split())
    assert (tmp_path / "census.md").exists()
    assert main(["check-model", "--census", "--types", "bert,not_a_model", "--out", str(tmp_path)]) == 2
    assert "types: unknown model type(s) not_a_model" in capsys.readouterr().out
    assert main(["check-model"]) == 2
    assert "needs ARCH|CHECKPOINT|PATH" in capsys.readouterr().out


def test_ctrl_c_keeps_the_model_types_surveyed(tmp_path):
    # Ctrl-C after the first row (raised where the parent takes it, in the progress callback):
    # that row is returned and written, marked as one of the two asked for
    def stop(row):
        raise KeyboardInterrupt

    rows = C.census(["bert", "gpt2"], jobs=1, progress=stop)
    assert len(rows) == 1 and rows[0]["model_type"] in ("bert", "gpt2")
    paths = C.write(rows, tmp_path, {"transformers": "x"}, asked=2)
    assert json.loads(paths["json"].read_text())["interrupted"] == {"surveyed": 1, "asked": 2}
    assert "Interrupted (Ctrl-C): 1 of the 2 model types asked for" in paths["md"].read_text()
    assert "interrupted" not in json.loads(C.write(rows, tmp_path, {"transformers": "x"},
                                                   asked=1)["json"].read_text())


def test_run_checks_small_whole_models_and_finds_a_wrong_patch(tmp_path, monkeypatch):
    every = C.model_types()
    rows = [C.survey(t, every[t], run=True) for t in ("llama", "convnext")]
    llama, convnext = rows[0]["run"], rows[1]["run"]
    assert llama["cut"] == "widths and heads" and llama["params"] <= C.MAX_PARAMS
    for dtype in ("fp32", "bf16"):  # every norm patched, both residual adds fused, within the bound
        assert llama[dtype]["ok"] and llama[dtype]["patched"] == 5 and llama[dtype]["fused"] == 2, llama
    assert "no small build runs on token ids" in convnext["none"]  # an image model: not run, and why
    s = C.summary(rows)["run"]
    assert s == {"asked": 2, "run": 1, "ok": 1, "failed": [],
                 "not_run_by_reason": {"no small build runs on token ids": 1}}

    # a patched forward 0.1% off: the whole-model check finds it (fp32's bound is 2 err + 1.2e-7)
    from normlab.hf import patching

    right = patching._backend_call
    monkeypatch.setattr(patching, "_backend_call",
                        lambda spec: lambda *a: right(spec)(*a) * 1.001)
    wrong = C.survey("llama", every["llama"], run=True)
    assert not wrong["run"]["fp32"]["ok"] and wrong["run"]["fp32"]["excess"] > 1e-4
    paths = C.write([wrong, rows[1]], tmp_path, {"transformers": "x"})
    assert json.loads(paths["json"].read_text())["summary"]["run"]["failed"] == ["llama"]
    table = paths["md"].read_text()
    assert "over the bound or raising: llama" in table
    assert "| llama | widths and heads | **over the bound**" in table
