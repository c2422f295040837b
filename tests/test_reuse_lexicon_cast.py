"""Units of issue 15 without services: cast parsing, lexicon matching and files, content hashing."""

from __future__ import annotations

import pytest

from voxbatch import keys
from voxbatch.models import RenderTask, SynthesisParams, TaskSegment, content_seed
from voxbatch.producer.cast import CastError, parse_cast, speaker
from voxbatch.producer.lexicon import Lexicon, LexiconError, load_lexicon
from voxbatch.reuse import VoiceDigests, content_hash
from voxbatch.storage import LocalStorage
from voxbatch.model_files import model_digest


def test_cast_parsing_and_speakers():
    cast = parse_cast(" Alice=voice_a , Dr. Bob=tone:bob,")
    assert cast == {"Alice": "voice_a", "Dr. Bob": "tone:bob"}
    assert speaker("Dr. Bob: Hello there.", cast) == ("tone:bob", "Hello there.")
    assert speaker("alice: lower case is not Alice.", cast) == (None, "alice: lower case is not Alice.")
    assert speaker("Alice said: hi", cast) == (None, "Alice said: hi")
    for bad, msg in [("Alice", "expected Name=voice"), ("Alice=a,Alice=b", "twice"), ("=a", "a name is"),
                     ("Alice=../x", "not a voice name")]:
        with pytest.raises(CastError, match=msg):
            parse_cast(bad)


def test_lexicon_whole_word_case_sensitive_and_cjk():
    lex = Lexicon((("SQL", "sequel"), ("行长", "航长"), ("C++", "C plus plus"), ("New York", "Noo Yawk")))
    assert lex.apply("SQL, MySQL, sql, SQLs and SQL.") == "sequel, MySQL, sql, SQLs and sequel."
    assert lex.apply("银行行长说") == "银行航长说"  # CJK: no word boundaries
    assert lex.apply("I like C++ and New York.") == "I like C plus plus and Noo Yawk."
    assert lex.apply("nothing here") == "nothing here"


def test_lexicon_files(tmp_path):
    tsv = tmp_path / "a.tsv"
    tsv.write_text("# comment\n\nSQL\tsequel\n", encoding="utf-8")
    assert load_lexicon(tsv).entries == (("SQL", "sequel"),)
    tsv.write_text("SQL\tsequel\nSQL\tess queue ell\n", encoding="utf-8")
    with pytest.raises(LexiconError, match=r"a.tsv:2: term 'SQL' already defined on line 1"):
        load_lexicon(tsv)
    pls = tmp_path / "a.pls"
    pls.write_text('<?xml version="1.0"?>\n<!DOCTYPE lexicon [<!ENTITY a "aaaa">]>\n<lexicon/>', encoding="utf-8")
    with pytest.raises(LexiconError, match="entity declarations"):
        load_lexicon(pls)
    pls.write_text('<lexicon xmlns="http://www.w3.org/2005/01/pronunciation-lexicon">\n'
                   '<lexeme><grapheme>tomato</grapheme><phoneme>t</phoneme></lexeme>\n</lexicon>', encoding="utf-8")
    with pytest.raises(LexiconError, match="no <alias> entries"):
        load_lexicon(pls)
    with pytest.raises(LexiconError, match="unsupported lexicon type"):
        load_lexicon(tsv.rename(tmp_path / "a.txt"))


def _task(**update) -> RenderTask:
    seg = TaskSegment(id="0000-00000", chapter=0, text="Hello.", seed=1)
    base = dict(job_id="j1", voice="v", format="wav", params=SynthesisParams(), segments=[seg])
    return RenderTask(**{**base, **update})


def test_content_hash_covers_what_determines_the_audio():
    task = _task()
    seg = task.segments[0]
    h = content_hash("model-a", "voice-1", task, seg)
    assert h == content_hash("model-a", "voice-1", _task(job_id="otherjob", reuse=False), seg)  # not the job
    assert h == content_hash("model-a", "voice-1", task, seg.model_copy(update={"id": "0001-00007", "chapter": 1}))
    differ = [content_hash("model-b", "voice-1", task, seg), content_hash("model-a", "voice-2", task, seg),
              content_hash("model-a", "voice-1", _task(format="flac"), seg),
              content_hash("model-a", "voice-1", _task(params=SynthesisParams(speed=1.1)), seg),
              content_hash("model-a", "voice-1", task, seg.model_copy(update={"seed": 2})),
              content_hash("model-a", "voice-1", task, seg.model_copy(update={"text": "Hello!"}))]
    assert len({h, *differ}) == 7
    assert content_seed("Hello.", "v", SynthesisParams()) == content_seed("Hello.", "v", SynthesisParams())
    assert content_seed("Hello.", "v", SynthesisParams()) != content_seed("Hello.", "w", SynthesisParams())


def test_voice_digest_follows_the_stored_profile(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put(keys.voice("narrator"), b"profile one")
    digests = VoiceDigests(storage, ttl_s=0.0)
    first = digests.get("narrator")
    storage.put(keys.voice("narrator"), b"profile two")  # `voxbatch voice add narrator` again
    assert digests.get("narrator") != first
    assert digests.get("tone:x") == "builtin:tone:x"
    with pytest.raises(KeyError):
        digests.get("missing")


def test_model_digest_covers_synthesis_files_only(tmp_path):
    for name in ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx"):
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "CosyVoice-BlankEN").mkdir()
    (tmp_path / "CosyVoice-BlankEN" / "vocab.json").write_text("{}")
    d = model_digest(tmp_path)
    (tmp_path / "campplus.onnx").write_bytes(b"another frontend")  # makes voices, not audio
    assert model_digest(tmp_path) == d
    (tmp_path / "flow.pt").write_bytes(b"fine-tuned flow")
    assert model_digest(tmp_path) != d
