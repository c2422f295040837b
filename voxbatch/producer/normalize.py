"""Text normalization before segmentation: what the speaker should read, in words.

Per paragraph: detect Chinese vs English, run text normalization (TN: numbers, dates, units, symbols to
words) with `wetext` (as the official frontend does), then the cleanups of the official CosyVoice2
frontend:

- zh: blanks removed except between two ASCII words, ²/³ to 平方/立方, sentence dots to "。",
  " - " to "，", full-width brackets and backticks removed, dashes ("——", "—") to "，", a trailing
  comma turned into "。";
- en: numbers left over by TN spelled out, whitespace collapsed.

`wetext` (FST grammars shipped inside the wheel, works offline) is required. A few rules run around it
where it reads differently from a speaker: money and thousands separators, clock times with a.m./p.m.,
decades and roman chapter numbers before it; "nineteen zero five" -> "oh", month capitals after it
(en); "~" between numbers and digit runs of 17+ (zh) before it. If wetext raises on a paragraph (its
FST code has internal asserts), the paragraph's remaining digits are spelled out plainly instead of
failing the book: there is no second TN of our own (the earlier built-in one was dropped once wetext,
with the rules above, covered each of its cases: tests/test_segment.py `WETEXT_CASES`).

Deviations from the official frontend, on purpose:
- a paragraph is Chinese when it has at least as many Han characters as Latin words (official: any Han
  character), so an English paragraph quoting a Chinese name keeps English rules;
- "——" becomes "，" (official: a space, left between Chinese characters) so the dash stays a pause;
- " - " becomes "，" before blanks are removed (official: after, so it only applied between ASCII);
- a "." between two ASCII letters/digits ("v2.0", "example.com") is not turned into "。".
"""

from __future__ import annotations

import functools
import logging
import re
import unicodedata
from typing import Literal

Lang = Literal["zh", "en"]

log = logging.getLogger(__name__)

_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
_INVISIBLE = re.compile(r"[\u200b-\u200f\u2028\u2029\u2060\ufeff\u00ad]")


def detect_lang(text: str) -> Lang:
    """"zh" when Han characters are at least as many as Latin words, else "en"."""
    han = len(_HAN.findall(text))
    return "zh" if han and han >= len(_LATIN_WORD.findall(text)) else "en"


def is_only_punctuation(text: str) -> bool:
    """True when nothing is left to speak: only punctuation, symbols and blanks (or nothing at all)."""
    return all(unicodedata.category(c)[0] in "PSZ" or c.isspace() for c in text)


def normalize_text(text: str, lang: Lang | None = None) -> str:
    """Normalize one paragraph (newlines inside are treated as blanks)."""
    text = _INVISIBLE.sub("", text)
    text = " ".join(text.split())
    if not text or ("<|" in text and "|>" in text):
        return text  # special tokens inside: left as written (the official frontend does the same)
    lang = lang or detect_lang(text)
    return _normalize_zh(text) if lang == "zh" else _normalize_en(text)


# --------------------------------------------------------------------------------------------------------
# wetext


@functools.lru_cache(maxsize=2)
def _wetext_normalizer(lang: Lang):
    """A cached wetext Normalizer (loading its FSTs takes a moment)."""
    from wetext import Normalizer

    return Normalizer(lang=lang, operator="tn", remove_erhua=False)


def _wetext(text: str, lang: Lang) -> str | None:
    """wetext TN of one paragraph, or None when it failed on this input."""
    try:
        out = _wetext_normalizer(lang).normalize(text)
    except Exception as e:  # third-party FST code with internal asserts; spell digits rather than fail a book
        log.warning("wetext failed on %r (%s: %s); spelling its digits plainly", text[:80], type(e).__name__, e)
        return None
    # wetext escapes ASCII double quotes in its output.
    return out.replace('\\"', '"') if '\\"' not in text else out


# --------------------------------------------------------------------------------------------------------
# English


_ONES = (
    "zero one two three four five six seven eight nine ten "
    "eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ["", "thousand", "million", "billion", "trillion"]


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = []
    if hundreds:
        words.append(f"{_ONES[hundreds]} hundred")
    if rest:
        tens, ones = divmod(rest, 10)
        part = _ONES[rest] if rest < 20 else _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
        words.append(("and " if hundreds else "") + part)
    return " ".join(words)


def number_to_words(n: int) -> str:
    """Cardinal in the style of `inflect` (which the official frontend uses): 1234 ->
    "one thousand, two hundred and thirty-four"; numbers of 16+ digits are read digit by digit."""
    if n < 0:
        return "minus " + number_to_words(-n)
    if n < 1000:
        return _ONES[n] if n < 20 else _below_thousand(n)
    if n >= 10 ** (3 * len(_SCALES)):
        return " ".join(_ONES[int(d)] for d in str(n))
    groups = []
    scale = 0
    while n:
        n, g = divmod(n, 1000)
        groups.append((g, scale))
        scale += 1
    parts = [(g, f"{_below_thousand(g)} {_SCALES[s]}".strip()) for g, s in reversed(groups) if g]
    out = parts[0][1]
    for k, (g, words) in enumerate(parts[1:], start=1):
        last = k == len(parts) - 1
        out += (" and " if last and g < 100 and groups[0][0] == g else ", ") + words
    return out


def _digits_en(digits: str) -> str:
    return " ".join(_ONES[int(d)] for d in digits)


_GROUPED = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d]|[.,]\d)")
_MONEY = re.compile(r"([$£€])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d{2}))?(?!\d)")
_DIGITS = re.compile(r"\d+")
_CURRENCY = {"$": ("dollar", "dollars", "cent", "cents"), "£": ("pound", "pounds", "penny", "pence"),
             "€": ("euro", "euros", "cent", "cents")}


def spell_out_numbers(text: str) -> str:
    """Every remaining run of ASCII digits to words (the official `spell_out_number` rule)."""
    def spell(m: re.Match) -> str:
        return number_to_words(int(m.group())) if len(m.group()) < 16 else _digits_en(m.group())

    return _DIGITS.sub(spell, text)


def _money_en(m: re.Match) -> str:
    one, many, cent, cents = _CURRENCY[m.group(1)]
    whole = int(m.group(2).replace(",", ""))
    out = f"{number_to_words(whole)} {one if whole == 1 else many}"
    if m.group(3) and int(m.group(3)):
        c = int(m.group(3))
        out += f" and {number_to_words(c)} {cent if c == 1 else cents}"
    return out


_ROMAN_AFTER = re.compile(
    r"\b(Chapter|Part|Book|Volume|Act|Scene|CHAPTER|PART|BOOK|VOLUME|ACT|SCENE)\s+([IVXLCDM]+)\b"
)
_ROMAN_VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def roman_to_int(numeral: str) -> int:
    values = [_ROMAN_VALUES[c] for c in numeral.upper()]
    return sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))


# What English TN can change: digits, symbols, dotted acronyms ("U.S.A."), abbreviations ("Dr.").
# Paragraphs without any of these skip wetext (it costs ~5 ms per paragraph and would change nothing).
_EN_NEEDS_TN = re.compile(
    r"[\d&@#$£€¥%+=/<>~^°§]|[A-Za-z]\.[A-Za-z]|\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Prof|Mt|Ft|No|Co|Corp|Inc|Ltd|vs|etc"
    r"|Gen|Col|Capt|Lt|Sgt|Rev|Hon|Ave|Rd|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)\."
)


# Clock times with a.m./p.m. (also "am", "A.M."): "5 p.m." -> "five PM". wetext reads the abbreviation's
# dots as part of the time, so "5 p.m. The" lost its sentence break and "9 a.m., then" became "AM., then".
_CLOCK = re.compile(r"(?<![\d:.])(\d{1,2})(?::([0-5]\d))?\s*([ap])(\.?)\s?m\b(\.?)", re.IGNORECASE)
_SENTENCE_START = re.compile(r"\s*(?:$|[A-Z0-9\"“‘(\[])")


def _clock_en(m: re.Match) -> str:
    hour, minute = int(m.group(1)), m.group(2)
    if hour > 12:
        return m.group()  # "13 p.m." is not a time a reader would say; leave it to TN
    words = number_to_words(hour)
    if minute and minute != "00":
        words += " " + (f"oh {_ONES[int(minute)]}" if minute[0] == "0" else number_to_words(int(minute)))
    words += " AM" if m.group(3).lower() == "a" else " PM"
    # The abbreviation's last dot also ends the sentence when a new sentence (or the text) follows.
    if m.group(5) and _SENTENCE_START.match(m.string, m.end()):
        words += "."
    return words


def clock_times_en(text: str) -> str:
    return _CLOCK.sub(_clock_en, text)


_MONTHS = ("january february march april may june july august september october november december").split()


# Years wetext reads digit by digit after the century ("1905" -> "nineteen zero five"): a speaker says "oh".
_YEAR_ZERO = re.compile(r"\b(eleven|twelve|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen) zero "
                        r"(one|two|three|four|five|six|seven|eight|nine)\b")
_YEAR_OH = re.compile(r"(?<![\d.,])1[1-9]0[1-9](?![\d]|[.,]\d)")
# Decades ("the 1990s", "1900s", "2010s"), which wetext reads as "... nine hundred seconds".
_DECADE = re.compile(r"(?<![\d.,'])(1[1-9]\d0|20[1-9]0|2000)s\b")


def _decade_en(m: re.Match) -> str:
    year = int(m.group(1))
    if year == 2000:
        return "two thousands"
    high, low = divmod(year, 100)
    words = f"{number_to_words(high)} {'hundred' if low == 0 else number_to_words(low)}"
    return words[:-1] + "ies" if words.endswith("y") else words + "s"


def capitalize_months(original: str, normalized: str) -> str:
    """Month names TN lowercased ("the fifth of january") capitalised again.

    A month the input never wrote in lower case is capitalised everywhere; one it did ("they march",
    "it may rain") only where TN's date form puts it, after "of" ("the third of march")."""
    written = set(re.findall(r"[a-z]+", original))
    for month in _MONTHS:
        pattern = rf"\b{month}\b" if month not in written else rf"(?<=\bof ){month}\b"
        normalized = re.sub(pattern, month.capitalize(), normalized)
    return normalized


def _normalize_en(text: str) -> str:
    original = text
    # "Chapter XII" -> "Chapter twelve": TN leaves roman numerals alone, a speaker would say them as letters.
    text = _ROMAN_AFTER.sub(lambda m: f"{m.group(1)} {number_to_words(roman_to_int(m.group(2)))}", text)
    text = clock_times_en(text)
    text = _DECADE.sub(_decade_en, text)
    # Money and thousands separators first: wetext 0.1.8 reads "1,234" as "thousand two hundred ..."
    # (it drops the "one").
    text = _MONEY.sub(_money_en, text)
    text = _GROUPED.sub(lambda m: number_to_words(int(m.group().replace(",", ""))), text)
    if not _EN_NEEDS_TN.search(text):
        return " ".join(text.split())
    out = _wetext(text, "en")
    if out is not None:
        if _YEAR_OH.search(original):
            out = _YEAR_ZERO.sub(r"\1 oh \2", out)
        out = capitalize_months(original, out)
    text = spell_out_numbers(text if out is None else out)
    return " ".join(text.split())


# --------------------------------------------------------------------------------------------------------
# Chinese


_ZH_DIGITS = "零一二三四五六七八九"
_ZH_UNITS = ["", "十", "百", "千"]
_ZH_SECTIONS = ["", "万", "亿", "万亿"]


def _zh_section(n: int) -> str:
    """0 < n < 10000, with inner zeros read as 零."""
    out, zero = "", False
    for power in (3, 2, 1, 0):
        d = n // 10**power % 10
        if d == 0:
            zero = bool(out)
            continue
        if zero:
            out += "零"
            zero = False
        out += _ZH_DIGITS[d] + _ZH_UNITS[power]
    return out


def zh_number(n: int) -> str:
    """Chinese cardinal: 1234 -> 一千二百三十四, 10 -> 十, 100000 -> 十万; 17+ digits read one by one."""
    if n == 0:
        return "零"
    if n >= 10**16:
        return "".join(_ZH_DIGITS[int(d)] for d in str(n))
    sections = []
    k = 0
    while n:
        n, s = divmod(n, 10000)
        sections.append((s, k))
        k += 1
    out, gap = "", False
    for s, k in reversed(sections):
        if s == 0:
            gap = bool(out)
            continue
        if out and (gap or s < 1000):
            out += "零"
        out += _zh_section(s) + _ZH_SECTIONS[k]
        gap = False
    return out[1:] if out.startswith("一十") else out


def _zh_digits(digits: str) -> str:
    return "".join(_ZH_DIGITS[int(d)] for d in digits)


def remove_blanks_zh(text: str) -> str:
    """Drop blanks, except a single one between two ASCII non-blank characters ("iPhone 15")."""
    text = " ".join(text.split())
    out = []
    for i, c in enumerate(text):
        if c == " ":
            before, after = text[i - 1] if i else "", text[i + 1] if i + 1 < len(text) else ""
            if not (before.isascii() and after.isascii() and before and after):
                continue
        out.append(c)
    return "".join(out)


_ZH_DOT = re.compile(r"(?<![A-Za-z0-9])\.|\.(?![A-Za-z0-9])")
_ZH_BRACKETS = str.maketrans("", "", "（）【】`")
_ZH_DASH = re.compile(r"[—―]+")
_ZH_TRAILING_COMMA = re.compile(r"[，,、]+$")


_ZH_RANGE = re.compile(r"(?<=\d)\s*[~～]\s*(?=\d)")  # "20~30" -> "20至30" (wetext leaves "~")
_ZH_LONG_DIGITS = re.compile(r"\d{17,}")  # ids and codes, read digit by digit (wetext mixes in a cardinal)


def _zh_fallback(text: str) -> str:
    return _DIGITS.sub(lambda m: zh_number(int(m.group())) if len(m.group()) < 17 else _zh_digits(m.group()), text)


def _normalize_zh(text: str) -> str:
    text = _ZH_LONG_DIGITS.sub(lambda m: _zh_digits(m.group()), _ZH_RANGE.sub("至", text))
    out = _wetext(text, "zh")
    text = (_zh_fallback(text) if out is None else out).replace("~", "").replace("～", "")  # no tilde read aloud
    text = " ".join(text.split()).replace(" - ", "，")
    text = remove_blanks_zh(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = _ZH_DOT.sub("。", text)
    text = text.translate(_ZH_BRACKETS)
    text = _ZH_DASH.sub("，", text)
    return _ZH_TRAILING_COMMA.sub("。", text)
