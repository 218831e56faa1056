"""Tokenizers: llama2.c's `tokenizer.bin` (docs/models.md) and a thin wrapper of a Hugging Face
`tokenizer.json`, with one interface: `encode(text, bos=True) -> ids`, `decode(ids) -> str`, and
`stream(prev)` for text that arrives one token at a time (a multi-byte character split over byte-fallback
tokens is held back until it is whole).
"""
from __future__ import annotations

import codecs
import re
from pathlib import Path

import numpy as np

from .loaders import require_extra

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


class Llama2cTokenizer:
    """The SentencePiece-style BPE of llama2.c: pieces (bytes) with merge scores.

    encode: BOS (optional), the id of " " when the text is not empty (dummy prefix), the id of each UTF-8 code
    point or its bytes as byte-fallback ids (byte + 3), then merges of the adjacent pair whose concatenation is
    a piece, best score first (the leftmost pair on a tie), until none applies; EOS (optional).
    decode: a piece that follows BOS loses its leading space; `<0xXX>` pieces are raw bytes.
    """

    def __init__(self, pieces: list[bytes], scores, bos_id: int = 1, eos_id: int = 2):
        self.pieces = list(pieces)
        self.scores = np.asarray(scores, dtype=np.float32)
        self.bos_id, self.eos_id = bos_id, eos_id
        self._ids = {}
        for i, p in enumerate(self.pieces):
            self._ids.setdefault(p, i)

    @classmethod
    def byte_level(cls, extra=()) -> "Llama2cTokenizer":
        """<unk>, <s>, </s>, the 256 byte pieces <0x00>..<0xFF> (ids 3..258), then the `extra` pieces, each
        bytes (score 0) or a (bytes, score) pair: the smallest tokenizer any text encodes with (a toy model's,
        vocab_size 259 + len(extra)). Merges favour the higher score; a multi-byte piece is only ever formed by
        merging pieces the vocabulary holds (so give its parts too: b"a", b"b", b"ab")."""
        pieces = [(b"<unk>", 0.0), (b"\n<s>\n", 0.0), (b"\n</s>\n", 0.0)]
        pieces += [(b"<0x%02X>" % i, 0.0) for i in range(256)]
        for i, e in enumerate(extra):
            if isinstance(e, (bytes, bytearray)):
                e = (e, 0.0)
            if not (isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], (bytes, bytearray))):
                raise TypeError(f"extra[{i}]: expected bytes or a (bytes, score) pair, got {e!r}")
            pieces.append((bytes(e[0]), float(e[1])))
        return cls([p for p, _ in pieces], [s for _, s in pieces])

    def save(self, path) -> Path:
        """Write llama2.c's tokenizer.bin (what from_file reads): int32 max piece length, then per piece float32
        score, int32 length, the bytes."""
        path = Path(path)
        out = [np.int32(max((len(p) for p in self.pieces), default=0)).tobytes()]
        for p, s in zip(self.pieces, self.scores):
            out += [np.float32(s).tobytes(), np.int32(len(p)).tobytes(), bytes(p)]
        path.write_bytes(b"".join(out))
        return path

    @classmethod
    def from_file(cls, path, vocab_size: int | None = None) -> "Llama2cTokenizer":
        """Read tokenizer.bin: int32 max_token_length, then per token float32 score, int32 length, the bytes.
        Reads `vocab_size` tokens (all of the file when None); ValueError naming the file when it ends early or
        holds another number of tokens (a tokenizer of another model)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: {path} does not exist")
        buf = path.read_bytes()
        pieces, scores, pos = [], [], 4
        want = "" if vocab_size is None else f" (expected {vocab_size} tokens, the model's vocab_size)"
        while pos < len(buf) if vocab_size is None else len(pieces) < vocab_size:
            if pos == len(buf):   # ends on a token boundary: whole, but not the model's vocabulary
                raise ValueError(f"{path}: {len(pieces)} tokens, the model's vocab_size is {vocab_size}: a "
                                 "tokenizer of another model?")
            if pos + 8 > len(buf):
                raise ValueError(f"{path}: truncated tokenizer: token {len(pieces)} needs bytes {pos}..{pos + 8}, "
                                 f"the file has {len(buf)}{want}")
            score, n = float(np.frombuffer(buf, "<f4", 1, pos)[0]), int(np.frombuffer(buf, "<i4", 1, pos + 4)[0])
            if n < 0 or pos + 8 + n > len(buf):
                raise ValueError(f"{path}: truncated tokenizer: token {len(pieces)} of {n} bytes at offset "
                                 f"{pos + 8}, the file has {len(buf)}{want}")
            pieces.append(buf[pos + 8:pos + 8 + n])
            scores.append(score)
            pos += 8 + n
        if pos < len(buf):
            raise ValueError(f"{path}: more than the model's vocab_size = {vocab_size} tokens ({len(buf) - pos} "
                             "bytes left after them): a tokenizer of another model?")
        return cls(pieces, scores)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of `text` as run.c's encode makes them: BOS first (bos), a dummy-prefix space, UTF-8 code
        points (byte fallback for the others), then the best-scoring merges; EOS last (eos)."""
        ids = [self.bos_id] if bos else []
        raw = text.encode("utf-8")

        def piece_ids(cp: bytes) -> list[int]:  # a piece's id, else its bytes' byte-fallback ids (byte + 3)
            return [self._ids[cp]] if cp in self._ids else [b + 3 for b in cp]

        if raw:  # the dummy prefix
            ids.extend(piece_ids(b" "))
        i = 0
        while i < len(raw):  # one code point: a lead byte and up to three continuation bytes
            j = i + 1
            while j < len(raw) and raw[j] & 0xC0 == 0x80 and j - i < 4:
                j += 1
            ids.extend(piece_ids(raw[i:j]))
            i = j
        while True:
            best = None
            for k in range(len(ids) - 1):
                merged = self._ids.get(self.pieces[ids[k]] + self.pieces[ids[k + 1]])
                if merged is not None and (best is None or self.scores[merged] > self.scores[best[1]]):
                    best = (k, merged)
            if best is None:
                break
            k, merged = best
            ids[k:k + 2] = [merged]
        return ids + [self.eos_id] if eos else ids

    def piece_bytes(self, prev: int | None, token: int) -> bytes:
        """The bytes token `token` stands for after token `prev` (BOS and EOS stand for nothing)."""
        if token in (self.bos_id, self.eos_id):
            return b""
        if not 0 <= token < len(self.pieces):
            raise ValueError(f"token {token}: outside this tokenizer's {len(self.pieces)} pieces (a model with a "
                             "larger vocabulary than its tokenizer sampled it)")
        piece = self.pieces[token]
        if prev == self.bos_id and piece.startswith(b" "):
            piece = piece[1:]
        m = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(m.group(1), 16)]) if m else piece

    def decode(self, ids, prev: int | None = None) -> str:
        """The text of `ids` (following token `prev`); invalid UTF-8 becomes U+FFFD."""
        out = bytearray()
        for t in ids:
            out += self.piece_bytes(prev, int(t))
            prev = int(t)
        return out.decode("utf-8", errors="replace")

    def stream(self, prev: int | None = None) -> "ByteStream":
        """A decoder of ids arriving one at a time (after token `prev`): push(id) returns the text completed so
        far (whole UTF-8 characters), flush() the rest."""
        return ByteStream(self, prev)


class ByteStream:
    """Text of a Llama2cTokenizer's tokens pushed one at a time: `push(id) -> str` returns the text completed by
    this token (a partial UTF-8 character is held back), `flush()` whatever is left."""

    def __init__(self, tokenizer: Llama2cTokenizer, prev: int | None):
        self._tok, self._prev = tokenizer, prev
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        data = self._tok.piece_bytes(self._prev, int(token))
        self._prev = int(token)
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the Llama2cTokenizer interface (BOS added here, not by the
    tokenizer's post-processor)."""

    def __init__(self, tokenizer, bos_id: int = 1, eos_id: int = 2):
        self.tokenizer, self.bos_id, self.eos_id = tokenizer, bos_id, eos_id

    @classmethod
    def from_file(cls, path, bos_id: int = 1, eos_id: int = 2) -> "HFTokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: {path} does not exist")
        return cls(require_extra("tokenizers").Tokenizer.from_file(str(path)), bos_id, eos_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of `text` (the tokenizer.json's pipeline, no special tokens added by it), BOS first (bos),
        EOS last (eos)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids, prev: int | None = None) -> str:
        """The text of `ids`; with `prev`, as it reads after token `prev` (the difference of the two decodes)."""
        ids = [int(t) for t in ids]
        if prev is None:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode([prev] + ids)[len(self.tokenizer.decode([prev])):]

    def stream(self, prev: int | None = None) -> "TextStream":
        """A decoder of ids arriving one at a time (after token `prev`): push(id) returns the new text, flush()
        the rest."""
        return TextStream(self, prev)


class TextStream:
    """`ByteStream` for an HFTokenizer: decodes all tokens so far and returns the new text, holding it back while
    it ends in U+FFFD (a character still incomplete)."""

    def __init__(self, tokenizer: HFTokenizer, prev: int | None):
        self._tok, self._prev, self._ids, self._done = tokenizer, prev, [], 0

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        text = self._tok.decode(self._ids, self._prev)
        if text.endswith("\ufffd"):
            return ""
        new, self._done = text[self._done:], len(text)
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids, self._prev)
        new, self._done = text[self._done:], len(text)
        return new


def load_tokenizer(path, bos_id: int = 1, eos_id: int = 2, vocab_size: int | None = None):
    """A tokenizer from `path`: a tokenizer.json (or a folder holding one) is a Hugging Face tokenizer, any other
    file a llama2.c tokenizer.bin (`vocab_size` tokens of it, all when None). FileNotFoundError naming the path
    when it is missing."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"tokenizer: {path} does not exist")
    if path.suffix == ".json":
        return HFTokenizer.from_file(path, bos_id, eos_id)
    return Llama2cTokenizer.from_file(path, vocab_size)
