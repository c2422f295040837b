"""CosyVoice2 at full size with random weights, a synthetic book corpus and one voice prompt.

Speed does not depend on weight values, so the GPU benchmark builds each part at the official
CosyVoice2-0.5B sizes (`bench/cosyvoice2_full.yaml`, plus the Qwen2.5-0.5B body below) and
initialises it randomly. Random weights never emit eos, so every segment's length is forced from its
text the way real speech would come out: 25 speech tokens per second of audio, ~4.5 Chinese
characters or ~2.6 English words per second (min_tokens = max_tokens = that count).

`tiny=True` swaps in the test fixture's sizes so the whole benchmark runs on a CPU in seconds.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from voxbatch.worker.cosyvoice2.checkpoint import read_config
from voxbatch.worker.cosyvoice2.forced_lengths import EN_WORDS_PER_S, TOKENS_PER_S, ZH_CHARS_PER_S, cjk_chars, forced_speech_tokens
from voxbatch.worker.cosyvoice2.flow import CausalFlow, FlowDims, fixed_noise
from voxbatch.worker.cosyvoice2.hift import FP32_MODULES, HiFTGenerator, HiftDims
from voxbatch.worker.cosyvoice2.llm import QWEN_DIR, CosyVoice2LM, LlmDims

HERE = Path(__file__).resolve().parent
FULL_YAML = HERE / "cosyvoice2_full.yaml"

MEL_PER_S = 50  # mel frames per second
ZH_CHARS_PER_TEXT_TOKEN = 1.4  # Qwen2 BPE on Chinese prose
EN_TEXT_TOKENS_PER_WORD = 1.3
PROMPT_S = 8.0  # the voice prompt: 200 speech tokens, 400 mel frames

# Qwen2.5-0.5B (CosyVoice-BlankEN/config.json of the official model); vocab includes the specials.
QWEN_FULL = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
)
QWEN_TINY = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=1024, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
)


def write_model_dir(root: Path, tiny: bool = False, fixture_yaml: Path | None = None) -> Path:
    """A model folder with `cosyvoice2.yaml` and `CosyVoice-BlankEN/config.json` (weights: `save_llm`)."""
    root.mkdir(parents=True, exist_ok=True)
    yaml = fixture_yaml if tiny else FULL_YAML
    if yaml is None or not yaml.is_file():
        raise FileNotFoundError(f"model yaml {yaml} not found")
    shutil.copy(yaml, root / "cosyvoice2.yaml")
    qwen = dict(QWEN_TINY if tiny else QWEN_FULL)
    qwen.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", tie_word_embeddings=True,
                torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151643, use_sliding_window=False)
    (root / QWEN_DIR).mkdir(exist_ok=True)
    (root / QWEN_DIR / "config.json").write_text(json.dumps(qwen, indent=2))
    # A small byte-level BPE with Qwen2's pre-tokenizer (make-tiny's), so the worker's own
    # CosyVoice2Engine can tokenize text here (stage e2e_engine); its ids fit either vocab.
    from voxbatch.worker.cosyvoice2.tiny import TinyDims, write_tokenizer

    write_tokenizer(root / QWEN_DIR, TinyDims())
    return root


def save_llm(model: CosyVoice2LM, model_dir: Path) -> None:
    """`llm.pt` in the official layout (the vLLM backend exports from it), bf16 to halve the bytes."""
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    torch.save(state, model_dir / "llm.pt")


def write_official_model_dir(root: Path, tiny: bool = False, fixture_dir: Path | None = None) -> Path:
    """A complete official-layout folder a `voxbatch worker` loads: the yaml and tokenizer of
    `write_model_dir`, llm.pt / flow.pt / hift.pt with the same random weights `build_*` make (same
    seeds), and the fixture's small ONNX files standing in for the voice front end (never run here)."""
    write_model_dir(root, tiny=tiny, fixture_yaml=(fixture_dir / "cosyvoice2.yaml") if fixture_dir else None)
    save_llm(build_llm(root, "cpu", torch.float32), root)
    torch.save({k: v.contiguous() for k, v in build_flow(root, "cpu", torch.float32).state_dict().items()}, root / "flow.pt")
    torch.save({k: v.contiguous() for k, v in build_hift(root, "cpu", torch.float32).state_dict().items()}, root / "hift.pt")
    for name in ("campplus.onnx", "speech_tokenizer_v2.onnx"):
        if fixture_dir is not None and (fixture_dir / name).is_file():
            shutil.copy(fixture_dir / name, root / name)
    return root


@torch.no_grad()
def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for matrices/convs, N(0, 1) rows
    for embeddings, ones for norm scales, small biases. Keeps activations O(1) through deep stacks."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            bound = 1.0 if id(p) in embeddings else 1.0 / math.sqrt(p[0].numel())
            draw = torch.empty(p.shape).uniform_(-bound, bound, generator=gen)
        elif ("norm" in name and name.endswith("weight")) or name.endswith("alpha"):
            draw = torch.ones(p.shape)
        else:
            draw = torch.empty(p.shape).uniform_(-0.02, 0.02, generator=gen)
        p.copy_(draw.to(p.dtype))


def build_llm(model_dir: Path, device: str, dtype: torch.dtype, seed: int = 1) -> CosyVoice2LM:
    dims = LlmDims.from_model_dir(model_dir)
    with torch.device("cpu"):
        model = CosyVoice2LM(dims)
    _randomize(model, seed)
    with torch.no_grad():
        # The three stop ids (eos and the two after it) never come out of a random model, so every
        # segment runs to the length forced from its text; eos is masked before min_tokens anyway.
        model.llm_decoder.bias[dims.speech_token_size :] = -30.0
    model.llm.model.lm_head.weight = model.body.embed_tokens.weight  # tied, as in the official file
    return model.to(device=device, dtype=dtype).eval()


def build_flow(model_dir: Path, device: str, dtype: torch.dtype, seed: int = 2) -> CausalFlow:
    dims = FlowDims.from_config(read_config(model_dir))
    model = CausalFlow(dims)
    _randomize(model, seed)
    model = model.to(device=device, dtype=dtype).eval()
    model.decoder.noise = fixed_noise(device)
    return model


def build_hift(model_dir: Path, device: str, dtype: torch.dtype, seed: int = 3) -> HiFTGenerator:
    """HiFT with the F0 predictor and source merge in fp32 whatever `dtype` (as `load_hift` does)."""
    model = HiFTGenerator(HiftDims.from_config(read_config(model_dir)))
    _randomize(model, seed)
    model = model.to(device).eval()
    for name, child in model.named_children():
        if name not in FP32_MODULES:
            child.to(dtype)
    return model


# -- corpus ------------------------------------------------------------------------------------------

# Common characters and words to draw sentences from (text content does not change the cost; its length does).
_ZH = (
    "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定"
    "行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些"
    "然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公"
    "无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将"
    "组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处理府研质村构"
)
_EN = (
    "the of and to in was he that it his her you as had with for she not at but be on him they by have this what "
    "said were from all one my there been which an their we would when so me no could if more into out time up "
    "then only some them very man well now about like before over any little our old your than know down after "
    "great other such should these can must good much upon made where long again through never house own first "
    "might two think come those eyes came see being how back life father under while mother still away nothing "
    "thought without room face heart light night door morning people hand world young told day last most once "
    "voice window garden letter evening answered looked turned believe across perhaps together almost whispered"
).split()


@dataclass(frozen=True)
class Segment:
    id: str
    lang: str  # "zh" | "en"
    text: str
    speech_tokens: int  # forced output length (min = max)
    text_tokens: int  # Qwen text tokens of `text` (estimated from its length)

    @property
    def audio_s(self) -> float:
        return self.speech_tokens / TOKENS_PER_S


def plan_text(text: str) -> tuple[str, int, int]:
    """(lang, speech tokens, text tokens) from a segment's text: how long real speech of it would be."""
    speech = forced_speech_tokens(text)
    if cjk_chars(text):
        return "zh", speech, max(1, math.ceil(len(text) / ZH_CHARS_PER_TEXT_TOKEN))
    return "en", speech, max(1, math.ceil(len(text.split()) * EN_TEXT_TOKENS_PER_WORD) + 1)


def text_token_ids(text: str, n: int, vocab: int) -> list[int]:
    """Stand-in Qwen token ids for a text: n ids drawn from a generator seeded by the text."""
    rng = random.Random(text)
    return [rng.randrange(0, min(vocab, 151643)) for _ in range(n)]


def _sentence(rng: random.Random, lang: str, seconds: float) -> str:
    if lang == "zh":
        n = max(2, round(seconds * ZH_CHARS_PER_S))
        chars = [rng.choice(_ZH) for _ in range(n)]
        for cut in range(rng.randint(4, 12), n - 2, rng.randint(6, 14)):
            chars[cut] += "，"
        return "".join(chars) + "。"
    n = max(2, round(seconds * EN_WORDS_PER_S))
    words = [rng.choice(_EN) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def make_corpus(n: int = 500, seed: int = 0, min_s: float = 2.0, max_s: float = 15.0) -> list[Segment]:
    """n book-like sentences, half Chinese, half English; audio lengths log-normal around 6 s, in [2, 15]."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lang = "zh" if i % 2 == 0 else "en"
        seconds = min(max_s, max(min_s, rng.lognormvariate(math.log(6.0), 0.5)))
        text = _sentence(rng, lang, seconds)
        lang, speech, text_tok = plan_text(text)
        out.append(Segment(f"s{i:04d}", lang, text, speech, text_tok))
    return out


@dataclass
class VoicePrompt:
    """One 8-second voice prompt of the right shapes (random values)."""

    text_tokens: list[int]  # transcript of the prompt, Qwen ids
    speech_tokens: list[int]  # (200,)
    mel: torch.Tensor  # (400, 80) fp32
    embedding: torch.Tensor  # (192,) speaker embedding

    @classmethod
    def random(cls, speech_vocab: int, text_vocab: int, seed: int = 7) -> VoicePrompt:
        gen = torch.Generator().manual_seed(seed)
        n_tok, n_mel = int(PROMPT_S * TOKENS_PER_S), int(PROMPT_S * MEL_PER_S)
        n_text = math.ceil(PROMPT_S * ZH_CHARS_PER_S / ZH_CHARS_PER_TEXT_TOKEN)
        return cls(
            text_tokens=torch.randint(0, min(text_vocab, 151643), (n_text,), generator=gen).tolist(),
            speech_tokens=torch.randint(0, speech_vocab, (n_tok,), generator=gen).tolist(),
            mel=torch.randn(n_mel, 80, generator=gen) * 2.0 - 5.0,
            embedding=torch.randn(192, generator=gen),
        )
