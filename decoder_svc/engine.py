"""The decoder engine: one ``step()`` = ``schedule()``, ``execute_model()``, ``update_from_output()``.

Single-threaded; the gRPC layer wraps it in a thread. Cross-attention KV is
filled from outside: each step lists in ``to_encode`` the requests whose cross
blocks were just reserved, the owner has the encoder service write their
cross KV at those block ids, then calls ``mark_encoded``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoder_svc.block_manager import BlockManager
from decoder_svc.detokenizer import OutputText
from decoder_svc.model_runner import ModelRunner
from decoder_svc.sampler import Sampler, TokenLogprobs
from decoder_svc.scheduler import CapacityError, Scheduler
from decoder_svc.sequence import Sequence
from shared.sampling_params import SamplingParams

__all__ = ["CapacityError", "DecoderEngine", "RequestOutput", "StepOutput"]


@dataclass
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step (the end token included when sampled).
        text: new text; special tokens (the end token too) are never part of it, nor
            text held back because it may begin a stop string, nor a matched stop
            string / stop token's text (unless ``include_stop_str_in_output``).
        finished: True on the request's last output.
        finish_reason: "stop" (end token, stop token id or stop string) or "length"
            (max_tokens / model max length) once finished.
        prompt_tokens: decoder prompt length.
        completion_tokens: tokens generated so far, the end token included.
        stop_reason: on a "stop": the stop token id (the end token's too) or the stop string.
        logprobs: one ``TokenLogprobs`` per ``new_token_ids`` entry when the request asked
            for logprobs, else None.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class StepOutput:
    """``to_encode``: (request_id, cross block ids) pairs to hand to the encoder; ``outputs``: per-request results."""

    to_encode: list[tuple[str, list[int]]] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)


class DecoderEngine:
    """Continuous-batching decoder over a paged self KV cache and a caller-owned cross KV pool.

    Args:
        model: e.g. ``shared.models.whisper.WhisperForConditionalGeneration``
            (``config``, ``generation``, ``forward``, ``compute_logits``).
        tokenizer: HF tokenizer used to detokenize outputs.
        cross_kv_cache: ``[num_layers, 2, num_cross_blocks, block_size, H, Dh]``,
            written by the encoder service; its block count sizes the cross pool.
        num_self_blocks: self-attention KV blocks allocated by the engine.
        block_size: tokens per block of both caches.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most query tokens in one step (>= the model max length).
        attention_backend: ``torch`` or ``triton`` (``kernels.attention_backend``).

    Raises:
        ValueError: ``cross_kv_cache`` does not have the model's layout, or the
            attention backend cannot run here.
    """

    def __init__(
        self,
        model,
        tokenizer,
        cross_kv_cache: torch.Tensor,
        num_self_blocks: int,
        block_size: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        attention_backend: str = "torch",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        gen = model.generation
        self.eos_token_id = gen.eos_token_id
        self.default_prompt = list(gen.decoder_prompt_ids)
        self.max_total_len = min(gen.max_length, model.config.max_target_positions)
        self.block_manager = BlockManager(num_self_blocks, int(cross_kv_cache.shape[2]), block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler(gen.suppress_tokens, gen.begin_suppress_tokens,
                               getattr(gen, "forced_bos_token_id", None), getattr(gen, "forced_eos_token_id", None))
        self.model_runner = ModelRunner(model, cross_kv_cache, num_self_blocks, block_size, self.sampler, attention_backend)

    def add_request(
        self,
        request_id: str,
        encoder_len: int,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        encoder_cache_key: str | None = None,
    ) -> None:
        """Queues a request; its cross blocks are reserved at a later ``step()``.

        Args:
            encoder_len: cross-attention KV length (1500 for Whisper's 30 s window;
                the source token count for text models).
            prompt_token_ids: decoder prompt; default ``model.generation.decoder_prompt_ids``.
            priority: lower value = scheduled earlier; ties first come first served
                (``decoder_svc.scheduler``).
            encoder_cache_key: content key of the encoder input
                (``decoder_svc.encoder_cache``): while another unfinished request
                with this key holds cross KV, this one shares it and is never
                listed in ``to_encode``. None: always encoded.

        Raises:
            CapacityError: it can never fit the KV pools / batch token limit.
            ValueError: duplicate request id, bad encoder_len, prompt or stop_token_ids.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        prompt = list(self.default_prompt if prompt_token_ids is None else prompt_token_ids)
        max_src = self.model.config.max_source_positions
        if not 1 <= encoder_len <= max_src:
            raise ValueError(f"encoder_len must be in [1, {max_src}], got {encoder_len}")
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) >= self.max_total_len:
            raise ValueError(f"prompt has {len(prompt)} tokens, the model max length is {self.max_total_len}")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {list(params.stop_token_ids)}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        seq = Sequence(request_id, prompt, encoder_len, params, self.eos_token_id, self.max_total_len, priority)
        seq.output_text = OutputText(self.tokenizer, params.stop, params.include_stop_str_in_output)
        self.scheduler.add(seq, encoder_cache_key)

    def step(self) -> StepOutput:
        """One engine iteration: schedule, run the decoder, append tokens and stream them."""
        so = self.scheduler.schedule()
        token_ids = self.model_runner.execute_model(so)
        logprobs = self.sampler.take_logprobs()
        # Appends the tokens; each sequence's check_stop detokenizes and matches stop strings.
        finished = self.scheduler.update_from_output([s.request_id for s in so.scheduled_seqs], token_ids)
        out = StepOutput(to_encode=[(s.request_id, list(s.cross_block_ids)) for s in so.to_encode])
        finished_ids = {s.request_id for s in finished}
        for seq, tok in zip(so.scheduled_seqs, token_ids):
            out.outputs.append(self._make_output(seq, tok, seq.request_id in finished_ids, logprobs.get(seq.request_id)))
        return out

    def _make_output(self, seq: Sequence, token_id: int, finished: bool, logprobs: TokenLogprobs | None) -> RequestOutput:
        if finished:
            self._release(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token_id],
            text=seq.output_text.pop_delta(),
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            stop_reason=seq.stop_reason if finished else None,
            logprobs=None if logprobs is None else [logprobs],
        )

    def _release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def mark_encoded(self, request_id: str) -> bool:
        """The encoder has written ``request_id``'s cross KV; it may now be scheduled.

        Returns:
            False (and nothing changes) when the request is not waiting for its
            encoding, e.g. it was aborted while the encoder ran.
        """
        if request_id not in self.scheduler.encoding:
            return False
        self.scheduler.mark_encoded(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        """Frees every block of the request now; no further output is produced for it.

        An ENCODING request's cross blocks are freed too and may be handed to
        another request at the next step, so the owner must not let a late
        encoder write for an aborted request land after that (cancel or await
        the Encode call first).

        Returns:
            False when the request is unknown or already finished.
        """
        existed = self.scheduler.abort(request_id)
        self._release(request_id)
        return existed

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "block_size": bm.block_size,
            "num_self_blocks": bm.num_self_blocks,
            "num_free_self_blocks": bm.num_free_self_blocks,
            "num_cross_blocks": bm.num_cross_blocks,
            "num_free_cross_blocks": bm.num_free_cross_blocks,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
        }
