import subprocess
import sys

import pytest

import normlab
from normlab.cli import main
from normlab.commands import info_rows


def test_version_and_info_as_a_module():
    out = subprocess.run([sys.executable, "-m", "normlab", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == f"normlab {normlab.__version__}"
    out = subprocess.run([sys.executable, "-m", "normlab", "info"], capture_output=True, text=True,
                         check=True)
    assert "reference" in out.stdout and "auto picks" in out.stdout


def test_info_lists_every_backend_with_a_reason_when_unavailable():
    versions, backends = info_rows()
    import torch

    assert dict(versions)["torch"] == torch.__version__
    names = [b[0] for b in backends]
    assert names == ["reference", "cpu", "triton"]
    for name, status, why in backends:
        assert status in ("available", "unavailable")
        assert (status == "unavailable") == bool(why), (name, status, why)


def test_versions_name_torchs_build_where_its_wheel_metadata_does_not(monkeypatch):
    """PyPI's CUDA wheels say 2.6.0 in their metadata and 2.6.0+cu124 in torch.__version__: a
    record must say which build ran."""
    from importlib import metadata

    import torch

    from normlab import env

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "2.6.0" if name == "torch" else real(name))
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    assert env.versions()["torch"] == "2.6.0+cu124"


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "normlab" in capsys.readouterr().out


def test_error_text_keeps_its_brackets(capsys):
    # rich reads "[hf]" as markup and drops it: "pip install 'normlab[hf]'" printed as "pip install 'normlab'"
    assert main(["compare", "norms", "--lrs", "1e-3;normlab[hf]", "--out", "unused"]) == 2
    assert "normlab[hf]" in capsys.readouterr().out


def test_warmup_compiles_once_and_a_second_run_compiles_nothing(tmp_path):
    import os
    import re

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    cmd = [sys.executable, "-m", "normlab", "warmup", "--ops", "rms_norm", "--dtypes", "fp32", "--quiet"]
    counts = []
    for _ in range(2):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        found = re.search(r"compiled (\d+) kernel signatures, (\d+) were cached already; numba's cache now "
                          r"holds (\d+)",
                          " ".join(out.stdout.split()))
        assert found, out.stdout
        counts.append(tuple(map(int, found.groups())))
    (compiled, cached, held), again = counts
    assert compiled > 0 and cached == 0 and held == compiled
    assert again == (0, compiled, compiled)
    info = subprocess.run([sys.executable, "-m", "normlab", "info"], capture_output=True, text=True, env=env,
                          timeout=600)
    said = " ".join(info.stdout.split())
    assert f"{compiled} kernel signatures compiled" in said
    # rms_norm's forward and backward only: not "cold" beside a list of compiled signatures
    assert f"numba cache: partly warm (2 of {len(cpu_kernels())} kernels cached" in said, said


def cpu_kernels():
    from normlab.kernels import cpu

    return cpu.KERNELS


def test_warmup_names_a_bad_choice(capsys):
    assert main(["warmup", "--dtypes", "fp64"]) == 2
    assert "--dtypes takes a comma-separated list from fp32, bf16, fp16; got fp64" in " ".join(
        capsys.readouterr().out.split()
    )


def test_an_unknown_preset_is_the_first_thing_said(capsys):
    # it printed a note about full sizes on a CPU before the error
    assert main(["compare", "nosuch"]) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert said.startswith("error: unknown preset 'nosuch'"), said


def test_a_bad_flag_shows_its_subcommands_usage(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--nosuchflag"])
    err = capsys.readouterr().err
    assert err.startswith("usage: normlab bench") and "unrecognized arguments: --nosuchflag" in err


@pytest.mark.parametrize("stop", ["interrupted", "ctrl-c"])
def test_an_interrupted_pilot_says_what_is_kept_and_exits_130(monkeypatch, capsys, tmp_path, stop):
    # --tune took a path of its own, where a stopped run printed a traceback
    from normlab import experiments

    def tune_presets(*args, **kwargs):
        raise (
            experiments.Interrupted("pilot-pre-curse-lr0.006-s100 stopped at step 113")
            if stop == "interrupted"
            else KeyboardInterrupt()
        )

    monkeypatch.setattr(experiments, "tune_presets", tune_presets)
    assert main(["compare", "curse", "--size", "tiny", "--tune", "--out", str(tmp_path)]) == 130
    said = " ".join(capsys.readouterr().out.split())
    assert "run the same command again to resume" in said and "Traceback" not in said
    assert ("stopped at step 113" in said) == (stop == "interrupted")


def test_arms_is_a_choice_of_the_pilot(monkeypatch, capsys, tmp_path):
    # --arms picks the arms --tune pilots: without --tune, or with no pattern, it is refused by name;
    # with it, the patterns reach the pilot's settings
    from normlab import experiments

    assert main(["compare", "dyt", "--size", "tiny", "--arms", "derf*", "--out", str(tmp_path)]) == 2
    assert "--arms picks the arms --tune pilots: add --tune" in " ".join(capsys.readouterr().out.split())
    assert main(["compare", "dyt", "--size", "tiny", "--tune", "--arms", " , ", "--out", str(tmp_path)]) == 2
    assert "--arms must name at least one arm" in " ".join(capsys.readouterr().out.split())
    seen = {}

    def tune_presets(names, settings, console=None, command=""):
        seen["arms"] = settings.tune_arms
        raise KeyboardInterrupt

    monkeypatch.setattr(experiments, "tune_presets", tune_presets)
    assert main(["compare", "dyt", "--size", "tiny", "--tune", "--arms", "derf*,dyt0.5-*", "--out",
                 str(tmp_path)]) == 130
    assert seen["arms"] == ("derf*", "dyt0.5-*")
