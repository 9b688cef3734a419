"""Tokenize text into the token files train.data.tokens reads: train.bin and val.bin (flat uint16 token ids) and
meta.json, in OUT_DIR.

    python -m train.data.prepare_text book.txt more/*.txt data/my_text          # byte-level: vocabulary 256
    python -m train.data.prepare_text --python-stdlib data/python_stdlib        # this Python's own library sources
    python -m train.data.prepare_text --tokenizer gpt2 corpus.txt data/corpus   # tiktoken's GPT-2 BPE, if installed

Byte-level tokenization needs nothing installed and nothing downloaded: every byte is a token (0..255). With many
files, every k-th file (k = 1 / --val-fraction) is validation text, so both splits sample the whole corpus; with
a few, the last `--val-fraction` of the text. The two never share a window.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np


def stdlib_sources(limit_bytes: int) -> list[Path]:
    """Python's standard library sources (a real corpus on every machine), in a fixed order, up to `limit_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        files.append(path)
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return files


def encode(data: bytes, tokenizer: str) -> np.ndarray:
    if tokenizer == "bytes":
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
    try:
        import tiktoken
    except ImportError:
        sys.exit(f"--tokenizer {tokenizer} needs tiktoken (pip install tiktoken); --tokenizer bytes needs nothing.")
    encoding = tiktoken.get_encoding(tokenizer)
    ids = encoding.encode_ordinary(data.decode("utf-8", errors="replace"))
    return np.array(ids, dtype=np.uint16 if encoding.n_vocab <= 65536 else np.uint32)


def vocab_size(tokenizer: str) -> int:
    if tokenizer == "bytes":
        return 256
    import tiktoken

    return tiktoken.get_encoding(tokenizer).n_vocab


def prepare(files: list[Path], out_dir: Path, tokenizer: str = "bytes", val_fraction: float = 0.1) -> dict:
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must lie between 0 and 1.")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"no such text file: {', '.join(missing)}")
    every = round(1 / val_fraction)
    if len(files) >= 2 * every:  # every k-th file: both splits sample the whole corpus, not its last directories
        train_tokens = encode(b"\n".join(f.read_bytes() for i, f in enumerate(files) if i % every != every - 1), tokenizer)
        val_tokens = encode(b"\n".join(f.read_bytes() for i, f in enumerate(files) if i % every == every - 1), tokenizer)
    else:  # one text: its last part
        tokens = encode(b"\n".join(f.read_bytes() for f in files), tokenizer)
        split = int(len(tokens) * (1 - val_fraction))
        train_tokens, val_tokens = tokens[:split], tokens[split:]
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"vocab_size": vocab_size(tokenizer), "dtype": str(train_tokens.dtype), "tokenizer": tokenizer,
            "train_tokens": len(train_tokens), "val_tokens": len(val_tokens), "files": len(files)}
    # meta.json first, the .bin files last: a reader that finds both .bin files (train.data.sets.check_available) finds
    # a complete set. A crash never leaves a half-written file under a real name.
    (out_dir / ".meta.json.partial").write_text(json.dumps(meta, indent=2) + "\n")
    (out_dir / ".meta.json.partial").replace(out_dir / "meta.json")
    for name, part in (("val.bin", val_tokens), ("train.bin", train_tokens)):
        partial = out_dir / f".{name}.partial"
        part.tofile(partial)
        partial.replace(out_dir / name)
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tokenize text files into train.bin / val.bin / meta.json.")
    parser.add_argument("paths", nargs="+", type=Path, help="TEXT_FILE ... OUT_DIR (with --python-stdlib: OUT_DIR)")
    parser.add_argument("--python-stdlib", action="store_true", help="tokenize this Python's standard library sources")
    parser.add_argument("--max-mb", type=float, default=8.0, help="with --python-stdlib: how much source to take")
    parser.add_argument("--tokenizer", default="bytes", help="bytes (vocabulary 256) or a tiktoken encoding (gpt2)")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args(argv)
    if args.python_stdlib:
        if len(args.paths) != 1:
            parser.error("with --python-stdlib give only OUT_DIR")
        files, out_dir = stdlib_sources(int(args.max_mb * 2**20)), args.paths[0]
    else:
        if len(args.paths) < 2:
            parser.error("give at least one text file and OUT_DIR")
        files, out_dir = args.paths[:-1], args.paths[-1]
    meta = prepare(files, out_dir, args.tokenizer, args.val_fraction)
    print(f"{out_dir}: {meta['train_tokens']:,} training and {meta['val_tokens']:,} validation tokens from "
          f"{meta['files']} file(s), vocabulary {meta['vocab_size']} ({meta['tokenizer']})")


if __name__ == "__main__":
    main()
