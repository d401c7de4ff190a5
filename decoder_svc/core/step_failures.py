"""Failures of one engine step that belong to one request: that request ends, the step goes on for the others.

An exception raised while the step handles one request's own rows -- its
sampling (penalties, warpers, the draw), its samples' forks, its beam search
step, its detokenization -- is caught per request (``StepFailures.guard``);
``DecoderEngine.step`` then frees every block of that request, drops its rows
from the rest of the step and hands its owner one ``RequestOutput`` whose
``error`` is the request's status. The other rows are computed from their own
logits rows only, so their tokens are exactly what they would have been.

An exception outside those per-request parts (the model forward, the batch
tensors) is not attributable to one request and still fails the whole step.

Status of a request's failure (``shared.errors.status_for``):

* an ``ArithmeticError`` (overflow, division by zero) came from its sampling
  parameters: INVALID_ARGUMENT, naming the parameters it set;
* anything else is a bug met by that request alone: INTERNAL, naming the
  request and the stage.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from decoder_svc.core.outputs import ModelRunnerOutput, RequestOutput
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.core.scheduler_output import SchedulerOutput
from shared.errors import InvalidRequestError, ServiceError

log = logging.getLogger(__name__)

_SHOWN_ID_CHARS = 256


class RequestStepError(ServiceError):
    """One request failed inside a shared engine step (a bug it alone met); INTERNAL."""


def _shown(request_id: str) -> str:
    return request_id if len(request_id) <= _SHOWN_ID_CHARS else request_id[:_SHOWN_ID_CHARS] + "..."


def set_parameters(params: SamplingParams) -> str:
    """``params``' fields that differ from the defaults, as ``name=value`` (for error messages)."""
    changed = [
        f"{f.name}={getattr(params, f.name)!r}"
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != f.default
    ]
    return ", ".join(changed) or "all defaults"


def request_error(request_id: str, stage: str, exc: BaseException, params: SamplingParams) -> ServiceError:
    """The status one request's failure ends it with (module docstring).

    Args:
        request_id: the request (its group id: the client's id).
        stage: where in the step it failed, e.g. "beam search step".
        exc: what was raised.
        params: the request's sampling parameters.

    Returns:
        ``InvalidRequestError`` (INVALID_ARGUMENT) for an ``ArithmeticError``, else ``RequestStepError`` (INTERNAL).
    """
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ArithmeticError):
        err: ServiceError = InvalidRequestError(
            f"request {_shown(request_id)!r}: its sampling parameters ({set_parameters(params)}) "
            f"cannot be computed in the {stage} ({what}); use values nearer the defaults"
        )
    else:
        err = RequestStepError(f"internal error in request {_shown(request_id)!r} during the {stage}: {what}")
    err.__cause__ = exc
    return err


class StepFailures:
    """The requests that failed in one step: request (group) id -> the error it ends with.

    ``aborted`` holds those whose blocks the engine already freed.
    """

    def __init__(self) -> None:
        self.errors: dict[str, ServiceError] = {}
        self.aborted: set[str] = set()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.errors

    def __bool__(self) -> bool:
        return bool(self.errors)

    def add(self, request_id: str, stage: str, exc: BaseException, params: SamplingParams) -> None:
        """Records ``request_id``'s failure (its first one wins)."""
        if request_id in self.errors:
            return
        log.warning(
            "request %r failed in the %s; the step goes on for the others", _shown(request_id), stage, exc_info=exc
        )
        self.errors[request_id] = request_error(request_id, stage, exc, params)

    @contextmanager
    def guard(self, request_id: str, stage: str, params: SamplingParams) -> Iterator[None]:
        """Runs the block; an ``Exception`` it raises is recorded as ``request_id``'s failure instead."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - one request's failure, recorded for it alone
            self.add(request_id, stage, exc, params)

    def pending_aborts(self) -> list[str]:
        """Failed requests whose blocks are not freed yet; they count as freed from now on."""
        ids = [rid for rid in self.errors if rid not in self.aborted]
        self.aborted.update(ids)
        return ids

    def outputs(self) -> list[RequestOutput]:
        """One final output per failed request, carrying its error."""
        return [
            RequestOutput(
                request_id=rid,
                new_token_ids=[],
                text="",
                finished=True,
                finish_reason=None,
                prompt_tokens=0,
                completion_tokens=0,
                error=err,
            )
            for rid, err in self.errors.items()
        ]

    def without(self, so: SchedulerOutput, out: ModelRunnerOutput) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """The step's plan and results without the failed requests' rows (the same objects when none is left out)."""
        keep = [i for i, s in enumerate(so.scheduled_seqs) if s.group_id not in self.errors]
        if len(keep) == len(so.scheduled_seqs):
            return so, out
        seqs = [so.scheduled_seqs[i] for i in keep]
        ids = {s.request_id for s in seqs}
        so = SchedulerOutput(seqs, [so.num_scheduled_tokens[i] for i in keep], so.to_encode, so.preempted)
        out = ModelRunnerOutput(
            seq_ids=[out.seq_ids[i] for i in keep],
            sampled_token_ids=[out.sampled_token_ids[i] for i in keep],
            logprobs={k: v for k, v in out.logprobs.items() if not self._owns(k)},  # samples 1.. too
            extra_token_ids={k: v for k, v in out.extra_token_ids.items() if k in ids},
            beam_logprobs={k: v for k, v in out.beam_logprobs.items() if k in ids},
        )
        return so, out

    def _owns(self, seq_id: str) -> bool:
        """``seq_id`` is a failed request or one of its samples (``decoder_svc.core.sequence.sample_seq_id``)."""
        return seq_id in self.errors or any(seq_id.startswith(f"{rid}\x00") for rid in self.errors)
