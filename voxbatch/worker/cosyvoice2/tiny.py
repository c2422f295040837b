"""`voxbatch model make-tiny DIR`: a random CosyVoice2 model directory in the official layout.

For tests, demos and benchmarks on machines without the real weights. Every file has the official
format and names, so the same loading code runs as for `CosyVoice2-0.5B`:

  cosyvoice2.yaml            HyperPyYAML with the official tags, tiny sizes (model sections only)
  llm.pt / flow.pt / hift.pt state dicts with the official keys (hift in the
                             `parametrizations.weight.original0/1` weight-norm layout)
  CosyVoice-BlankEN/         byte-level BPE trained here on built-in English + Chinese text, Qwen2 config
  speech_tokenizer_v2.onnx   stand-in with the official signature: feats (1, 128, T), feats_length (1,)
                             -> int64 (1, T // 4) = floor(|mean of 4 frames @ w| * 997) mod S
  campplus.onnx              stand-in: (B, T, 80) -> (B, 192) = 3 tanh(rms_t(x) @ W + b)
  prompt.wav                 a 3-s voice-like test signal for `voxbatch voice add` (not speech)

The weights are random but deterministic from `seed`; the output is noise, not speech. The LLM's
stop-token biases are set very low, so a sequence always runs to its max_tokens (random weights
would stop at arbitrary points otherwise), which makes audio lengths predictable in tests.
The flow keeps the official 512-wide encoder: the official code hard-codes that width.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from voxbatch.worker.cosyvoice2.checkpoint import empty_init, read_config
from voxbatch.model_files import QWEN_DIR
from voxbatch.tokenizer import QWEN2_SPLIT

BASE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2's own, right after the BPE vocabulary
STOP_BIAS = -30.0  # llm_decoder bias of eos and the two other stop ids: never sampled
DEMO_PROMPT = "prompt.wav"  # a voice-like test signal for `voice add` in demos
SPEECH_TOKENIZER_FRAMES = 4  # whisper mel frames (100 Hz) per speech token (25 Hz)


@dataclass(frozen=True)
class TinyDims:
    """Sizes of the tiny model (the official 0.5B values in comments)."""

    bpe_vocab: int = 1000  # Qwen vocab before specials (151643)
    hidden: int = 128  # 896; head_dim = 32 keeps vLLM's CPU attention usable
    intermediate: int = 256  # 4864
    n_layers: int = 2  # 24
    n_heads: int = 4  # 14
    n_kv_heads: int = 2  # 2
    speech_tokens: int = 300  # 6561
    encoder_heads: int = 4  # 8
    encoder_units: int = 64  # 2048
    encoder_blocks: int = 1  # 6
    estimator_channels: int = 64  # 256
    estimator_head_dim: int = 32  # 64
    estimator_heads: int = 4  # 8
    estimator_blocks: int = 1  # 4
    estimator_mid_blocks: int = 1  # 12
    hift_channels: int = 64  # 512


# The model sections of the official cosyvoice2.yaml, tags and key names unchanged, sizes as fields.
YAML_TEMPLATE = """\
# Tiny random-weight CosyVoice2 made by `voxbatch model make-tiny` (seed {seed}). Not a real model.
# Official cosyvoice2.yaml layout (model sections only); the Qwen2 sizes are in CosyVoice-BlankEN/config.json.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 24000
llm_input_size: {d.hidden}
llm_output_size: {d.hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {d.speech_tokens}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {d.speech_tokens}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: {d.encoder_heads}
        linear_units: {d.encoder_units}
        num_blocks: {d.encoder_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{d.estimator_channels}]
            dropout: 0.0
            attention_head_dim: {d.estimator_head_dim}
            n_blocks: {d.estimator_blocks}
            num_mid_blocks: {d.estimator_mid_blocks}
            num_heads: {d.estimator_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: 80
    base_channels: {d.hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {d.hift_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
"""

# Text the tiny tokenizer is trained on: enough English and Chinese for merges of common words.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Chapter one: the morning train left the station at seven.
She opened the window, listened to the rain, and wrote a letter to her brother about the harbour.
Good morning, everyone! This is a short test of speech synthesis, reading numbers like one, two and three.
We are testing how a voice sounds when it reads a book aloud, sentence after sentence, page after page.
Hello world. How are you today? I am fine, thank you. What time is it? It is half past four.
The river runs through the old town, under seven bridges, past the market and the library.
Is this the real life? It was the best of times, it was the worst of times, a tale of two cities.
今天天气很好，我们去公园散步。你好，世界！这是一个语音合成的测试。
他打开窗户，听着雨声，给哥哥写了一封信。第一章：早上七点，火车离开了车站。
我们正在测试声音朗读一本书的效果，一句接一句，一页接一页。谢谢大家，明天见。
"""


# -- weights -----------------------------------------------------------------------------------------


def _randn(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def _init_tensor(name: str, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random value for one state-dict entry, by its role (read from the key name and shape)."""
    shape = tuple(like.shape)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return _randn(gen, shape, 0.05)
    if leaf == "alpha":  # Snake: a positive frequency per channel
        return torch.exp(_randn(gen, shape, 0.2))
    if like.dim() == 1:  # LayerNorm / RMSNorm scale
        return 1.0 + _randn(gen, shape, 0.1)
    if "embed" in name and like.dim() == 2:  # token / speech / sos embeddings
        return _randn(gen, shape, 1.0)
    if leaf.startswith("pos_bias"):
        return _randn(gen, shape, 0.1)
    fan_in = math.prod(shape[1:])
    return _randn(gen, shape, 1.0 / math.sqrt(fan_in))


def _random_state(model: torch.nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every entry of the model's state dict, replaced in key order by a seeded random value."""
    return {name: _init_tensor(name, value, gen).contiguous() for name, value in sorted(model.state_dict().items())}


def _weight_norm_split(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (g, v) with w = g v / ||v|| over all dims but 0; v gets an arbitrary per-row scale."""
    g = w.flatten(1).norm(dim=1).reshape(-1, *([1] * (w.dim() - 1)))  # (C0, 1, 1)
    scale = torch.exp(_randn(gen, (w.shape[0],), 0.5)).reshape_as(g)
    return g, w * scale


def _llm_state(model_dir: Path, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from voxbatch.worker.cosyvoice2.llm import CosyVoice2LM, LlmDims

    dims = LlmDims.from_model_dir(model_dir)
    with empty_init():
        model = CosyVoice2LM(dims)
    state = _random_state(model, gen)
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]  # tied, one storage
    state["llm_decoder.weight"] = state["llm_decoder.weight"] * 3.0  # peaky enough for top-k/top-p to matter
    bias = state["llm_decoder.bias"].clone()
    bias[dims.speech_token_size :] = STOP_BIAS
    state["llm_decoder.bias"] = bias
    return state


def _flow_state(config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from voxbatch.worker.cosyvoice2.flow import CausalFlow, FlowDims

    with empty_init():
        model = CausalFlow(FlowDims.from_config(config))
    return _random_state(model, gen)


def _hift_state(config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random HiFT weights in the official layout: weight-normed convolutions as original0/original1."""
    from voxbatch.worker.cosyvoice2.hift import HiFTGenerator, HiftDims

    dims = HiftDims.from_config(config)
    with empty_init():
        model = HiFTGenerator(dims)
    state = _random_state(model, gen)
    # Voiced F0 around 150 Hz and a quiet output (exp of the log-magnitude), so the audio is not clipped.
    state["f0_predictor.classifier.weight"] = state["f0_predictor.classifier.weight"] * 10.0
    state["f0_predictor.classifier.bias"] = torch.full_like(state["f0_predictor.classifier.bias"], 150.0)
    post_bias = state["conv_post.bias"].clone()
    post_bias[: dims.n_fft // 2 + 1] -= 3.0
    state["conv_post.bias"] = post_bias
    state["conv_post.weight"] = state["conv_post.weight"] * 0.3
    # The official generator wraps every convolution in weight norm except the source down-samplers.
    normed = {
        name
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)) and not name.startswith("source_downs")
    }
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module = key.rsplit(".", 1)[0]
        if module in normed and key.endswith(".weight"):
            g, v = _weight_norm_split(value, gen)
            out[f"{module}.parametrizations.weight.original0"] = g
            out[f"{module}.parametrizations.weight.original1"] = v
        else:
            out[key] = value
    return out


# -- tokenizer -----------------------------------------------------------------------------------


def write_tokenizer(folder: Path, d: TinyDims) -> int:
    """Train the byte-level BPE (Qwen2's pipeline) and write the HF folder files; returns the vocab size."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=d.bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False, special_tokens=[]
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    base = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in BASE_SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    tok.model.save(str(folder))  # vocab.json + merges.txt
    added = {
        str(base + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, t in enumerate(BASE_SPECIALS)
    }
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    return base


def _qwen_config(d: TinyDims, base_vocab: int) -> dict:
    eos = base_vocab  # <|endoftext|>
    # Room for the 3 base specials and the CosyVoice2 specials the tokenizer adds, rounded up to 64.
    vocab = (base_vocab + 3 + 17 + 63) // 64 * 64
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "max_position_embeddings": 32768,
        "max_window_layers": d.n_layers,
        "model_type": "qwen2",
        "num_attention_heads": d.n_heads,
        "num_hidden_layers": d.n_layers,
        "num_key_value_heads": d.n_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# -- ONNX stand-ins ----------------------------------------------------------------------------------


def _onnx_model(graph):
    from onnx import helper

    # opset 17 / IR 8: old enough for any onnxruntime >= 1.14, which is what the frontend needs.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8, producer_name="voxbatch make-tiny")


def _speech_tokenizer_onnx(path: Path, n_tokens: int, rng: np.random.RandomState) -> None:
    """feats (1, 128, T) f32, feats_length (1,) i32 -> tokens (1, T // 4) i64."""
    from onnx import TensorProto, helper, numpy_helper, save

    w = (rng.randn(128, 1) / np.sqrt(128)).astype(np.float32)
    nodes = [
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[SPEECH_TOKENIZER_FRAMES], strides=[SPEECH_TOKENIZER_FRAMES]),
        helper.make_node("Transpose", ["pooled"], ["frames"], perm=[0, 2, 1]),  # (1, T/4, 128)
        helper.make_node("MatMul", ["frames", "w"], ["proj"]),  # (1, T/4, 1)
        helper.make_node("Squeeze", ["proj", "last_axis"], ["proj1"]),  # (1, T/4)
        helper.make_node("Abs", ["proj1"], ["mag"]),
        helper.make_node("Mul", ["mag", "scale"], ["scaled"]),
        helper.make_node("Floor", ["scaled"], ["floored"]),
        helper.make_node("Cast", ["floored"], ["ids"], to=TensorProto.INT64),
        helper.make_node("Mod", ["ids", "n_tokens"], ["tokens"]),
    ]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "last_axis"),
        numpy_helper.from_array(np.array(997.0, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array(n_tokens, dtype=np.int64), "n_tokens"),
    ]
    graph = helper.make_graph(
        nodes,
        "speech_tokenizer_stand_in",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "T_tok"])],
        initializer=inits,
    )
    save(_onnx_model(graph), str(path))


def _campplus_onnx(path: Path, rng: np.random.RandomState) -> None:
    """(B, T, 80) f32 -> (B, 192) f32 = 3 tanh(sqrt(mean_t x^2) @ W + b)."""
    from onnx import TensorProto, helper, numpy_helper, save

    w = (rng.randn(80, 192) / np.sqrt(80)).astype(np.float32)
    b = (rng.randn(192) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["input", "input"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[1], keepdims=0),  # (B, 80)
        helper.make_node("Sqrt", ["ms"], ["rms"]),
        helper.make_node("MatMul", ["rms", "w"], ["proj"]),
        helper.make_node("Add", ["proj", "b"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["t"]),
        helper.make_node("Mul", ["t", "three"], ["embedding"]),
    ]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(b, "b"),
        numpy_helper.from_array(np.array(3.0, dtype=np.float32), "three"),
    ]
    graph = helper.make_graph(
        nodes,
        "campplus_stand_in",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["B", 192])],
        initializer=inits,
    )
    save(_onnx_model(graph), str(path))


# -- the whole directory -------------------------------------------------------------------------------


def make_tiny(out_dir: str | Path, seed: int = 0, dims: TinyDims | None = None, overwrite: bool = False) -> Path:
    """Write a random official-format CosyVoice2 model directory into `out_dir`; returns its path."""
    d = dims or TinyDims()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty (pass overwrite=True / --force to write into it)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cosyvoice2.yaml").write_text(YAML_TEMPLATE.format(d=d, seed=seed), encoding="utf-8")
    folder = out / QWEN_DIR
    base_vocab = write_tokenizer(folder, d)
    _write_json(folder / "config.json", _qwen_config(d, base_vocab))
    _write_json(folder / "generation_config.json", {"bos_token_id": base_vocab, "eos_token_id": base_vocab, "max_new_tokens": 2048})

    config = read_config(out)
    gen = torch.Generator().manual_seed(seed)
    torch.save(_llm_state(out, gen), out / "llm.pt")
    torch.save(_flow_state(config, gen), out / "flow.pt")
    torch.save(_hift_state(config, gen), out / "hift.pt")
    rng = np.random.RandomState(seed)
    _speech_tokenizer_onnx(out / "speech_tokenizer_v2.onnx", d.speech_tokens, rng)
    _campplus_onnx(out / "campplus.onnx", rng)
    _demo_prompt(out / DEMO_PROMPT, rng)
    return out


def _demo_prompt(path: Path, rng: np.random.RandomState) -> None:
    """A 3-s, 24 kHz voice-like test signal (a gliding tone with harmonics and a syllable rhythm), so
    `voxbatch voice add NAME --wav DIR/prompt.wav` works offline. Not a recording of speech."""
    sr, seconds = 24000, 3.0
    t = np.arange(int(sr * seconds)) / sr
    f0 = 120 * np.exp(np.log(2.2) * t / seconds)  # 120 -> 264 Hz
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voiced = sum(np.sin(k * phase) / k for k in range(1, 7))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    audio = 0.2 * voiced * envelope / 2.5 + 0.003 * rng.standard_normal(t.size)
    sf.write(path, audio.astype(np.float32), sr, subtype="PCM_16")
