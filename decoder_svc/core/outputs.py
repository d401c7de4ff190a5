"""The values one engine step passes along: sampler -> model runner -> scheduler -> output stage -> caller.

vLLM v1's shape: ``Sampler`` returns a ``SamplerOutput``, ``ModelRunner.execute_model``
wraps it as a ``ModelRunnerOutput`` naming its rows, ``Scheduler.update_from_output``
and the output stage (``decoder_svc.core.output_processor``) consume that, and
``DecoderEngine.step`` hands a ``StepOutput`` of ``RequestOutput``s to its owner.
No torch here: beam log-probabilities are tensors but only typed as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ModelRunnerOutput", "RequestOutput", "SamplerOutput", "StepOutput", "TokenLogprobs"]


@dataclass
class TokenLogprobs:
    """Log-probabilities of one sampled token.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (natural log; ``decoder_svc.core.sampler``'s module
            docstring says of which distribution).
        rank: 1 + how many tokens have a strictly larger logprob.
        top: up to ``params.top_logprobs`` (token_id, logprob) pairs, most likely
            first; tokens filtered to ``-inf`` are left out.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SamplerOutput:
    """What ``Sampler.__call__`` computed for a batch of rows.

    Attributes:
        sampled_token_ids: one token id per row, in row order; -1 for a beam row
            (beams are chosen by the request's search, ``decoder_svc.core.sequence_group``).
        logprobs: sequence id -> the picked token's ``TokenLogprobs``, for rows whose
            params ask for logprobs; an n > 1 prompt step also lists samples 1..n-1
            under their ``sample_seq_id``.
        extra_token_ids: sequence id -> first tokens of samples 1..n-1 (n > 1 prompt
            steps that sampled; a row whose scores were not finite has none).
        beam_logprobs: sequence id -> ``[V]`` float32 CPU processed log-probabilities
            of each beam row.
        failed: sequence id -> the exception its row raised (its penalties, warpers or
            draw); its token is a placeholder -1 and nothing else is reported for it
            (``decoder_svc.core.step_failures``).
    """

    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    beam_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """One model step's results (vLLM v1 ``ModelRunnerOutput``).

    Attributes:
        seq_ids: the scheduled sequences' ids, in ``SchedulerOutput.scheduled_seqs`` order.
        sampled_token_ids: one token id per scheduled sequence, in that order (-1: a beam row).
        logprobs, extra_token_ids, beam_logprobs, failed: the sampler's, by sequence id
            (see ``SamplerOutput``); sparse, since most rows have none.
    """

    seq_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    beam_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)
    probe_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # [V] raw logits at params.probe_position


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
        index: which of the request's n samples / returned beams (0 = the best beam).
        score: beam search only: the hypothesis' HF score (sum of its token
            logprobs / generated_len ** length_penalty).
        error: set on the last output of a request that failed inside a step
            (``decoder_svc.core.step_failures``): a ``shared.errors.ServiceError`` whose
            code is the request's status (its blocks are already freed; the
            other fields carry nothing). The owner ends the request with it.
        probe_logits: ``[V]`` float32 raw logits at ``params.probe_position`` of the
            prompt, on the output of the step that computed that position (its prefill).
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
    index: int = 0
    score: float | None = None
    error: BaseException | None = None
    probe_logits: torch.Tensor | None = None


@dataclass
class StepOutput:
    """``to_encode``: (request_id, cross block ids) pairs to hand to the encoder; ``outputs``: per-request results."""

    to_encode: list[tuple[str, list[int]]] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
