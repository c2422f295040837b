"""Segmentation: chapters -> segments of a few sentences, each rendered into one audio file.

The rules are those of the official CosyVoice2 frontend (`split_paragraph`), applied per paragraph:

1. split after sentence punctuation (zh: 。？！；：、.?!; ; en: .?!;: ), keeping closing quotes and runs of
   punctuation ("?!", "...") with their sentence; text not ending in punctuation gets a final "。"/".";
2. greedy merge: a sentence joins the current segment unless that would pass `token_max_n` while the
   segment already has more than `token_min_n`;
3. a last segment shorter than `merge_len` is appended to the one before it.

Lengths: Chinese in characters (as official); other text through a pluggable `LengthFn`. `voxbatch
submit` and `voxbatch render` pass the model's own tokenizer (`CosyVoice2Tokenizer.token_length`, see
`producer.submit.segment_length_fn`) whenever a model directory is known, as the official rules do;
the tokenizer-free `estimate_tokens` is the fallback for the tone engine or when no model dir is set.

So a segment passes `token_max_n` only when (a) it is one sentence longer than that, (b) it was still at
most `token_min_n` before its last sentence (bound: `token_min_n` + that sentence), or (c) it is a
paragraph's last segment with a short tail (< `merge_len`) merged in.

Deviations from the official rules, on purpose:
- segments never cross a paragraph break (a paragraph break is a pause in the audio);
- a "." between two ASCII letters/digits ("v2.0", "e.g") does not end a sentence;
- a single sentence longer than `hard_max_n` is cut at commas, then at blanks (or anywhere, for
  Chinese), so one run-on sentence cannot make a segment the engine cannot render;
- segments with nothing to speak (only punctuation/symbols) are dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

from voxbatch.producer.cast import speaker
from voxbatch.producer.lexicon import Lexicon
from voxbatch.producer.normalize import Lang, detect_lang, is_only_punctuation, normalize_text
from voxbatch.models import Chapter, Segment

LengthFn = Callable[[str], int]


@dataclass(frozen=True)
class SplitRules:
    token_max_n: int = 80  # target upper length of a segment
    token_min_n: int = 60  # a segment shorter than this keeps taking sentences even past token_max_n
    merge_len: int = 20  # a last segment shorter than this joins the previous one
    comma_split: bool = False  # also split sentences at commas (official default: no)
    hard_max_n: int = 160  # a single sentence longer than this is cut (ours, not official)


DEFAULT_RULES = SplitRules()

_ZH_STOPS = frozenset("。？！；：、.?!;")
_EN_STOPS = frozenset(".?!;:")
_COMMAS = frozenset("，,")
_CLOSERS = frozenset("\"”’'」』）)]》")
_TOKEN = re.compile(r"[A-Za-z]+|\d|[^\sA-Za-z\d]")


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate of Qwen2 BPE tokens: a Latin word ~ 1 token per 6 letters, a digit,
    a Han character or a punctuation mark 1 each; blanks are free (BPE folds them into the next word)."""
    return sum(-(-len(t) // 6) if t[0].isascii() and t[0].isalpha() else 1 for t in _TOKEN.findall(text))


def split_sentences(text: str, lang: Lang, comma_split: bool = False) -> list[str]:
    """Sentences with their end punctuation (and any closing quotes) attached; nothing is lost."""
    stops = set(_ZH_STOPS if lang == "zh" else _EN_STOPS)
    if comma_split:
        stops |= _COMMAS
    sentences: list[str] = []
    start, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c in stops and not (c == "." and 0 < i < n - 1 and text[i - 1].isascii() and text[i - 1].isalnum()
                               and text[i + 1].isascii() and text[i + 1].isalnum()):
            j = i + 1
            while j < n and (text[j] in stops or text[j] in _CLOSERS):
                j += 1
            if text[start:j].strip():
                sentences.append(text[start:j])
            start = i = j
            continue
        i += 1
    tail = text[start:]
    if tail.strip():
        sentences.append(tail.rstrip() + ("。" if lang == "zh" else "."))
    return sentences


def _cut_long(sentence: str, lang: Lang, length: LengthFn, rules: SplitRules) -> list[str]:
    """Cut a sentence longer than hard_max_n into pieces of at most token_max_n: at commas, then at
    blanks (English; a single blank-free run longer than that stays whole) or characters (Chinese)."""
    if length(sentence) <= rules.hard_max_n:
        return [sentence]
    pieces: list[str] = []
    for clause in re.split(r"(?<=[，,、])", sentence):
        if not clause:
            continue
        if length(clause) > rules.token_max_n:
            units = re.split(r"(?<= )", clause) if lang == "en" else list(clause)
        else:
            units = [clause]
        for unit in units:
            if pieces and length(pieces[-1] + unit) <= rules.token_max_n:
                pieces[-1] += unit
            else:
                pieces.append(unit)
    return pieces


def split_paragraph(
    text: str, lang: Lang, length_fn: LengthFn | None = None, rules: SplitRules = DEFAULT_RULES
) -> list[str]:
    """One normalized paragraph -> segment texts (official greedy merge; see the module docstring)."""
    other = length_fn or estimate_tokens
    length: LengthFn = len if lang == "zh" else other
    sentences = [
        piece
        for sentence in split_sentences(text, lang, rules.comma_split)
        for piece in _cut_long(sentence, lang, length, rules)
    ]
    out: list[str] = []
    current = ""
    for sentence in sentences:
        if current and length(current + sentence) > rules.token_max_n and length(current) > rules.token_min_n:
            out.append(current)
            current = ""
        current += sentence
    if current:
        if out and length(current) < rules.merge_len:
            out[-1] += current
        else:
            out.append(current)
    return [s.strip() for s in out if not is_only_punctuation(s)]


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of a chapter text, inner newlines folded to blanks."""
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text) if block.strip()]


def segment_chapter(
    chapter: Chapter,
    length_fn: LengthFn | None = None,
    normalize: bool = True,
    rules: SplitRules = DEFAULT_RULES,
    cast: dict[str, str] | None = None,
    lexicon: Lexicon | None = None,
    **overrides,
) -> list[Segment]:
    """A chapter's segments. With a `cast`, a paragraph starting `Name:` is that voice's, prefix
    removed (producer/cast.py); a `lexicon` rewrites terms after normalization, before splitting.
    `overrides` (voice, speed, seed: a line item's own) go on every segment."""
    segments: list[Segment] = []
    for paragraph in paragraphs(chapter.text):
        voice = overrides.get("voice")
        if cast:
            voice, paragraph = speaker(paragraph, cast)
            voice = voice or overrides.get("voice")
        if is_only_punctuation(paragraph):
            continue  # scene breaks ("* * *"): TN would read the symbols out
        lang = detect_lang(paragraph)
        if normalize:
            paragraph = normalize_text(paragraph, lang)
        if lexicon is not None:
            paragraph = lexicon.apply(paragraph)
        for text in split_paragraph(paragraph, lang, length_fn, rules):
            segments.append(Segment(chapter=chapter.index, index=len(segments), text=text,
                                    **{**overrides, "voice": voice}))
    return segments


def segment_chapters(
    chapters: Iterable[Chapter],
    length_fn: LengthFn | None = None,
    normalize: bool = True,
    rules: SplitRules = DEFAULT_RULES,
    cast: dict[str, str] | None = None,
    lexicon: Lexicon | None = None,
) -> list[Segment]:
    """All segments of a book in reading order; `Segment.index` is the position within its chapter."""
    return [segment for chapter in chapters
            for segment in segment_chapter(chapter, length_fn, normalize, rules, cast, lexicon)]
