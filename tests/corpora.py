"""Small corpora written by the tests themselves: a 3-chapter book as .txt, .md and .epub."""

from __future__ import annotations

from pathlib import Path

CHAPTERS = [
    ("The Harbour", [
        "The boat came in at dawn. Gulls circled the mast and the crew pulled the ropes tight.",
        "Nobody on the pier said a word. The fisherman counted twelve crates of herring and smiled.",
    ]),
    ("The Market", [
        "By nine the market was full. Voices rose over the stalls, and the smell of bread filled the square.",
        "A child asked for an apple. Her mother paid two coins and they walked on toward the river.",
        "Clouds gathered in the west.",
    ]),
    ("The Storm", [
        "The storm broke before noon. Rain drummed on the roofs and the streets emptied within minutes.",
        "When it passed, the whole town came out to look at the sea, calm again and silver under the sun.",
    ]),
]


def write_txt(path: Path, chapters=CHAPTERS) -> Path:
    parts = []
    for i, (title, paras) in enumerate(chapters, 1):
        parts.append(f"Chapter {i}: {title}\n\n" + "\n\n".join(paras) + "\n")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def write_md(path: Path, chapters=CHAPTERS) -> Path:
    parts = [f"# {title}\n\n" + "\n\n".join(paras) + "\n" for title, paras in chapters]
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def write_epub(path: Path, chapters=CHAPTERS) -> Path:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("voxbatch-test-book")
    book.set_title("Harbour Town")
    book.set_language("en")
    items = []
    for i, (title, paras) in enumerate(chapters, 1):
        item = epub.EpubHtml(title=title, file_name=f"chap{i:02d}.xhtml", lang="en")
        item.content = f"<h1>{title}</h1>" + "".join(f"<p>{p}</p>" for p in paras)
        book.add_item(item)
        items.append(item)
    book.toc = items
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", *items]
    epub.write_epub(str(path), book)
    return path


def long_book(path: Path, chapters: int = 3, sentences: int = 120) -> Path:
    """A longer .txt book (many segments) for crash / cancel tests."""
    parts = []
    for c in range(1, chapters + 1):
        body = " ".join(f"Sentence {s} of chapter {c} tells a short part of the long story." for s in range(sentences))
        parts.append(f"Chapter {c}\n\n{body}\n")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


# A podcast script: a narrator (the job's --voice) and two cast members, one name not in the cast.
PODCAST = """# Episode One

Welcome to the show. Today two guests talk about the harbour.

Alice: Hello everyone, I am Alice. The boats came in early this morning.

Bob: And I am Bob. I counted twelve crates of herring on the pier.

Mallory: this line names nobody in the cast, so the narrator reads it as written.

Alice: Thank you, Bob. That is all for today.
"""
PODCAST_CAST = {"Alice": "tone:alice", "Bob": "tone:bob"}


def write_podcast(path: Path) -> Path:
    path.write_text(PODCAST, encoding="utf-8")
    return path


def write_items(path: Path, n: int) -> Path:
    """A .jsonl line-item batch of `n` short prompts, ids item-00000..; every 10th with its own voice."""
    import json

    from voxbatch.producer.normalize import number_to_words

    # Numbers written as words: text normalization has nothing to do (a catalog of this size is then
    # segmented in a fraction of a second instead of ~15 ms per item through wetext).
    rows = [{"id": f"item-{i:05d}", "text": f"Prompt {number_to_words(i)}: press the star key to continue."}
            for i in range(n)]
    for row in rows[::10]:
        row["voice"] = "tone:ivr"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def edit_one_paragraph(chapters=CHAPTERS):
    """The 3-chapter book with one paragraph of chapter 2 changed; returns (chapters, the new paragraph)."""
    edited = "A child asked for a pear. Her father paid three coins and they walked on toward the bridge."
    out = [(t, list(p)) for t, p in chapters]
    out[1][1][1] = edited
    return out, edited
