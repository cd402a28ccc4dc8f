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
    assert main(["check-model", "--census", "--types", "bert", "--jobs", "1", "--out", str(tmp_path)]) == 0
    assert "Of 1 model types, 1 build" in capsys.readouterr().out
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
