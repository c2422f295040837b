"""CosyVoice2's speech language model as a vLLM model class: a Qwen2 body, the speech embedding as
its input embedding, and `llm_decoder` (with bias) as its head.

A thin file on top of vLLM's own `Qwen2Model`, following the contract of vLLM's `qwen2.py`
(`embed_input_ids`, `forward`, `compute_logits`, `load_weights`), with explicit imports: the
official integration's `from vllm... import *` is what broke on vLLM 0.26+. The weights come from
the folder `vllm_export.export_for_vllm` writes (HF Qwen2 names; `lm_head` = llm_decoder).

Prompts reach the model only as embeddings (`enable_prompt_embeds=True`); token ids the engine
feeds back during decoding are speech tokens, embedded by `embed_input_ids`.

Version notes (0.26 .. 0.33): `compute_logits` lost its `sampling_metadata` argument and
`get_input_embeddings` became `embed_input_ids` before 0.26; both old spellings are accepted here so
an older engine still finds what it calls.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.sequence import IntermediateTensors

ARCHITECTURE = "CosyVoice2SpeechLM"  # must equal vllm_export.ARCHITECTURE (checked in register())


class CosyVoice2SpeechLM(nn.Module):
    # The exported folder uses HF names; Qwen2Model.load_weights stacks q/k/v and gate/up.
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        # vocab_size = speech_token_size + 3: embed_tokens is the speech embedding.
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            bias=True,  # llm_decoder is an nn.Linear with bias
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)  # (T,) -> (T, D)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:  # the pre-0.12 name
        return self.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)  # (T, D)

    def compute_logits(self, hidden_states: torch.Tensor, *_old_args: object) -> torch.Tensor | None:
        # (T, D) -> (T, S+3), llm_decoder's bias included. `_old_args`: sampling_metadata (< 0.11).
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)


def register() -> None:
    """Register the architecture with vLLM's model registry; safe to call any number of times.

    Also the `vllm.general_plugins` entry point, so vLLM processes that start on their own
    (engine core, workers) find the class too. The class object is registered (not a lazy
    "module:Class" string), so vLLM need not re-import this module in an inspection subprocess.
    """
    from vllm import ModelRegistry

    from voxbatch.worker.cosyvoice2.vllm_export import ARCHITECTURE as EXPORTED

    if EXPORTED != ARCHITECTURE:
        raise RuntimeError(f"exporter writes {EXPORTED!r} but the model registers {ARCHITECTURE!r}")
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, CosyVoice2SpeechLM)


class StreamPriority:
    """A vLLM worker extension (`ParallelConfig.worker_extension_cls`): the model's CUDA stream at a
    given priority, set through `collective_rpc` in the thread that runs the model's steps (the engine
    core's loop in its own process, or the driver thread of an in-process engine).

    Why: flow/HiFT run beside the LLM on streams of priority 0, vLLM's own stream. The torch backend's
    decode step goes on a stream above them (streaming.LLM_STREAM_PRIORITY), so its small kernels take
    SMs as flow/HiFT blocks retire; vLLM's steps queue behind whole flow kernels instead, and each of
    its steps waits for its sampled tokens before the next is scheduled. The worker on vLLM kept the
    GPU 58-69% busy in its LLM phase against 94% on torch (bench/results/gpu_h100_s38b_vllm_worker.json)."""

    def voxbatch_stream_priority(self, priority: int) -> int | None:
        """Move vLLM's current stream for this thread to a new one of `priority`, ordered after the old
        one's work; returns the priority vLLM's stream now has, None where there are no CUDA streams."""
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return None
        from vllm.utils.torch_utils import current_stream  # vLLM's record of the thread's stream (its patched set_stream)
        old = current_stream()
        new = torch.cuda.Stream(device=old.device, priority=priority)
        new.wait_stream(old)
        torch.cuda.set_stream(new)
        self.voxbatch_stream = new  # type: ignore[attr-defined]  # kept alive with the worker
        return current_stream().priority
