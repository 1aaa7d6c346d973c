"""Derive CLIP's `vocab.json` and `merges.txt` from OpenAI's BPE merge list.

The merge list ships in the `open_clip_torch` wheel as `open_clip/bpe_simple_vocab_16e6.txt.gz` (MIT licence).
The vocabulary is built the way CLIP builds it: the 256 byte symbols, the same with the end-of-word mark
`</w>`, one token per merge (the first 48,894 merges), then `<|startoftext|>` and `<|endoftext|>`: 49,408 ids.

Usage:
    pip download --no-deps open_clip_torch==3.3.0 -d /tmp/oc
    python scripts/make_clip_vocab.py /tmp/oc/open_clip_torch-3.3.0-py3-none-any.whl src/sdjax/assets/clip_tokenizer
"""

import gzip
import json
import sys
import zipfile
from pathlib import Path

NUM_MERGES = 49152 - 256 - 2


def byte_symbols() -> list[str]:
    """GPT-2's reversible map of the 256 byte values to printable characters, in CLIP's vocabulary order.

    Bytes that are printable map to themselves and come first; the others map to 256, 257, ... and follow.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def main(wheel: str, out_dir: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        lines = gzip.decompress(zf.read("open_clip/bpe_simple_vocab_16e6.txt.gz")).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]
    symbols = byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    print(f"wrote {len(tokens)} tokens and {len(merges)} merges to {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
