"""The text and code tokenizer: a byte-level BPE trained with Hugging Face ``tokenizers``.

Design choices:
- Byte level: every UTF-8 string encodes, and ``decode(encode(x)) == x`` exactly (emoji,
  any script, tabs, trailing spaces). No normalizer touches the text.
- Pre-tokenization splits like cl100k: words with their leading space, numbers in runs of at
  most 3 digits, punctuation runs, newlines kept together, and whitespace runs kept whole
  except the last space (which joins the next word), so indentation becomes a few tokens.
- The specials ``<|pad|> <|bos|> <|eos|>`` get the first ids. Text that *contains* such a
  string is encoded as plain text (``encode_special_tokens``), so documents cannot inject them.
- Training data is sampled from raw shards by weight (in characters), deterministically.
- Training sees no word longer than ``MAX_TRAIN_WORD`` characters: a longer run without a space
  (a DNA sequence, base64, a line of "=") is cut into pieces that long. The trainer's work on a
  word grows with its length times the merges that touch it, and it cannot be interrupted.
  Encoding is not bounded this way, only training.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from data.names import LAYOUT_FILE, TEXT_TOKENIZER_TRAINING_FILE, TOKENIZER_FILE
from data.vocab import TEXT_SPECIALS, VocabLayout

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# The tokenizers library holds each text's Encoding (offsets, token strings: ~180 bytes a
# character) until its call returns: one call is given at most this many characters.
ENCODE_CHARS = 1 << 20
# where SPLIT_PATTERN's pieces never span: after a line's end, before the next line's indentation
# when a character that is no space follows it (no alternative takes a line end and then more),
# so a text cut there encodes to its own ids: an indented file (JSON, code) cuts at every line
_SAFE_CUT = re.compile(r"(?<=[\r\n])(?=[^\S\r\n]*\S)")


def bpe_threads() -> int:
    """The threads the tokenizers library encodes with (its pool: RAYON_NUM_THREADS, else one a
    core)."""
    given = os.environ.get("RAYON_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else os.cpu_count() or 1


def encode_pieces(text: str) -> list[str]:
    """``text`` in pieces of at most ``ENCODE_CHARS`` characters where it can be cut without
    changing its ids; a stretch with no such place (a minified one-line file) stays whole."""
    pieces, start = [], 0
    while len(text) - start > ENCODE_CHARS:
        end = start + ENCODE_CHARS
        cuts = [m.start() for m in _SAFE_CUT.finditer(text, start + 1, end)]
        cut = cuts[-1] if cuts else next((m.start() for m in _SAFE_CUT.finditer(text, end)), None)
        if cut is None:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


MAX_TRAIN_WORD = 256
# each run matched from its start only (a match tried inside every shorter run costs ~100x)
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_TRAIN_WORD + 1},}}|(?<!\s)\s{{{MAX_TRAIN_WORD + 1},}}")


def bounded_words(texts: Iterable[str]) -> Iterator[str]:
    """``texts`` with every run of more than ``MAX_TRAIN_WORD`` spaces or non-spaces given in
    pieces of that length, as texts of their own (the rest of each text unchanged)."""
    for text in texts:
        start = 0
        for run in _LONG_RUN.finditer(text):
            yield text[start : run.start()]
            found = run.group()
            for piece in range(0, len(found), MAX_TRAIN_WORD):
                yield found[piece : piece + MAX_TRAIN_WORD]
            start = run.end()
        yield text[start:] if start else text


def new_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(
    texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, progress: bool = False
) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(TEXT_SPECIALS) + 1:
        raise ValueError(
            f"vocab size {vocab_size} is below the byte alphabet ({len(alphabet)}) plus specials"
        )
    tok = new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(TEXT_SPECIALS),
        initial_alphabet=alphabet,
        show_progress=progress,
    )
    tok.train_from_iterator(bounded_words(texts), trainer)
    return tok


@dataclass
class TextTokenizer:
    """A trained BPE plus the vocabulary layout it belongs to (loaded from one folder)."""

    tok: Tokenizer
    layout: VocabLayout

    def __post_init__(self) -> None:
        self.tok.encode_special_tokens = True
        ids = [self.tok.token_to_id(special) for special in TEXT_SPECIALS]
        if None in ids:
            raise ValueError(f"tokenizer lacks the specials {TEXT_SPECIALS}")
        self.pad_id, self.bos_id, self.eos_id = ids
        if self.tok.get_vocab_size() != self.layout.text_size:
            raise ValueError(
                f"tokenizer has {self.tok.get_vocab_size()} ids, the layout says "
                f"{self.layout.text_size}: they are from different trainings"
            )

    @classmethod
    def load(cls, folder: str | Path) -> TextTokenizer:
        folder = Path(folder)
        try:
            tok = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise ValueError(
                f"{folder / TOKENIZER_FILE}: cannot load the text tokenizer ({e})"
            ) from None
        return cls(tok, VocabLayout.load(folder / LAYOUT_FILE))

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, in calls of at most ``ENCODE_CHARS`` characters a BPE thread (a
        longer text in pieces: ``encode_pieces``); the texts and pieces of one call are encoded
        in parallel."""
        limit = ENCODE_CHARS * bpe_threads()
        out: list[list[int]] = [[] for _ in texts]
        batch: list[str] = []
        owners: list[int] = []
        size = 0
        for number, text in enumerate(texts):
            for piece in encode_pieces(text):
                if batch and size + len(piece) > limit:
                    self._encode_into(out, batch, owners)
                    batch, owners, size = [], [], 0
                batch.append(piece)
                owners.append(number)
                size += len(piece)
        if batch:
            self._encode_into(out, batch, owners)
        return out

    def _encode_into(self, out: list[list[int]], batch: list[str], owners: list[int]) -> None:
        encodings = self.tok.encode_batch(batch, add_special_tokens=False)
        for owner, encoding in zip(owners, encodings):
            out[owner].extend(encoding.ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]


def save_tokenizer(tok: Tokenizer, layout: VocabLayout, folder: str | Path, training: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / TOKENIZER_FILE))
    layout.save(folder / LAYOUT_FILE)
    (folder / TEXT_TOKENIZER_TRAINING_FILE).write_text(
        json.dumps(training, indent=1, sort_keys=True) + "\n"
    )


def sample_texts(
    sources: dict[str, Callable[[], Iterable[str]]],
    weights: dict[str, float],
    budget_chars: int,
    used: dict[str, int],
    *,
    ran_out: set[str] | None = None,
) -> Iterator[str]:
    """Texts from each source up to its share of ``budget_chars`` (share = weight / sum).

    ``sources`` maps a name to a zero-argument callable returning an iterator of texts. A source
    smaller than its share gives all it holds, once: nothing is repeated to fill a share (that
    would train the merges on copies and overstate what the tokenizer saw); such sources go to
    ``ran_out``. ``used`` receives the characters taken per source."""
    total = sum(weights.values())
    for name, make_iter in sources.items():
        share = int(budget_chars * weights[name] / total)
        taken = 0
        used[name] = 0
        for text in make_iter():
            if taken >= share:
                break
            piece = text[: share - taken]
            taken += len(piece)
            yield piece
        else:
            if ran_out is not None and taken < share:
                ran_out.add(name)
        used[name] = taken
