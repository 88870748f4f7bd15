"""Train the built-in models' byte-level BPE tokenizer; run once, by hand, and commit the result.

    .venv/bin/python engine/assets/train_tokenizer.py

The corpus is the running interpreter's standard library `.py` files (site-packages excluded),
read in sorted path order so one interpreter always yields the same tokenizer. A different
Python version has a different standard library, which is why the output, `tokenizer.json`
beside this script, is committed and training never runs at install time (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

VOCAB_SIZE = 16_384
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, <pad>=3 (builtin.py and config.json rely on it).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
OUTPUT = Path(__file__).resolve().parent / "tokenizer.json"


def corpus_files() -> list[Path]:
    """The standard library's `.py` files in sorted order, without third-party packages."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in stdlib.rglob("*.py") if "site-packages" not in p.relative_to(stdlib).parts]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def corpus_texts(files: list[Path]) -> Iterator[str]:
    """Each file's text; files that are not UTF-8 (a few encoding tests) are skipped whole,
    so no U+FFFD replacement characters leak into the merges."""
    for path in files:
        try:
            yield path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            logger.info("skipping %s", path)


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(files: list[Path]) -> Tokenizer:
    tokenizer = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(files), trainer=trainer, length=len(files))
    bos = SPECIAL_TOKENS[1]
    bos_id = tokenizer.token_to_id(bos)
    # BOS only at the start, as Llama's tokenizers do; applied when add_special_tokens=True.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
    )
    return tokenizer


def check(tokenizer: Tokenizer) -> None:
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"vocab size {tokenizer.get_vocab_size()} != {VOCAB_SIZE}")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"{token} has id {tokenizer.token_to_id(token)}")
    sample = "def f(x):\n    return x  # héllo 世界 🙂\n"
    if tokenizer.decode(tokenizer.encode(sample).ids) != sample:
        raise RuntimeError("round trip failed")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    files = corpus_files()
    start = time.perf_counter()
    tokenizer = train(files)
    elapsed = time.perf_counter() - start
    check(tokenizer)
    tokenizer.save(str(OUTPUT), pretty=True)
    logger.info("trained on %d files in %.1f s -> %s", len(files), elapsed, OUTPUT.name)


if __name__ == "__main__":
    main()
