"""The output stage of an engine step: detokenization, stop strings, ``RequestOutput``s (vLLM v1's output processor).

It runs after ``Scheduler.update_from_output``, which decided on token ids and
lengths. Per sequence that got a token it feeds the token to the sequence's
``OutputText`` (``decoder_svc.core.detokenizer``: incremental detokenizer + stop
strings, created on the sequence's first token), finishes a sequence whose text
completed a stop string (``Scheduler.finish_request``: its blocks are freed
now), and builds the request's output: the text delta (minus any text held
back because it may begin a stop string), finish and stop reason, usage,
logprobs. A finished beam search gets one output per returned hypothesis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from decoder_svc.core.detokenizer import OutputText
from decoder_svc.core.outputs import ModelRunnerOutput, RequestOutput, TokenLogprobs
from decoder_svc.core.scheduler import Scheduler, SchedulerOutput
from decoder_svc.core.sequence import Sequence
from decoder_svc.core.sequence_group import SequenceGroup
from decoder_svc.core.step_failures import StepFailures


class OutputProcessor:
    """Turns a step's tokens into ``RequestOutput``s.

    Args:
        tokenizer: HF tokenizer (``decode(ids, skip_special_tokens=True)``).
        scheduler: finishes sequences that end on a stop string.
        eos_token_id: the model's end token (a beam hypothesis that ends on it is a "stop").
        on_finish: called with every sequence that finished (frees its sampler
            generator and its place in a sequence group).
    """

    def __init__(
        self, tokenizer, scheduler: Scheduler, eos_token_id: int, on_finish: Callable[[Sequence], None]
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.eos_token_id = eos_token_id
        self.on_finish = on_finish

    def process(
        self,
        so: SchedulerOutput,
        out: ModelRunnerOutput,
        forked: list[Sequence],
        finished: Iterable[Sequence],
        failures: StepFailures,
    ) -> list[RequestOutput]:
        """One output per sequence that got a token this step: the scheduled non-beam ones, then ``forked``.

        Args:
            so: the step's plan.
            out: the model step's results.
            forked: samples forked this step with their first token (``SequenceGroups.fork_samples``).
            finished: the sequences ``Scheduler.update_from_output`` finished.
            failures: a request whose detokenization or stop-string check raises is recorded there
                (``decoder_svc.core.step_failures``) and gets no output; the others go on.
        """
        finished_ids = {s.request_id for s in finished}
        rows = [(s, t) for s, t in zip(so.scheduled_seqs, out.sampled_token_ids) if s.sampling_params.num_beams == 1]
        rows += [(c, c.output_token_ids[-1]) for c in forked]
        outputs = []
        for seq, tok in rows:
            if seq.group_id in failures:
                continue
            with failures.guard(seq.group_id, "detokenization of its output", seq.sampling_params):
                status = seq.status if seq.request_id in finished_ids else None
                self._output_text(seq)
                final = seq.update_text(status)
                if final is not status:  # its text completed a stop string
                    self.scheduler.finish_request(seq, final)
                outputs.append(self._make_output(seq, tok, final is not None, out.logprobs.get(seq.request_id)))
                outputs[-1].probe_logits = out.probe_logits.get(seq.request_id)
        return outputs

    def _output_text(self, seq: Sequence) -> OutputText:
        if seq.output_text is None:
            p = seq.sampling_params
            seq.output_text = OutputText(self.tokenizer, p.stop, p.include_stop_str_in_output)
        return seq.output_text

    def _make_output(
        self, seq: Sequence, token_id: int, finished: bool, logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        if finished:
            self.on_finish(seq)
        return RequestOutput(
            request_id=seq.group_id,
            new_token_ids=[token_id],
            text=seq.output_text.pop_delta(),
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            stop_reason=seq.stop_reason if finished else None,
            logprobs=None if logprobs is None else [logprobs],
            index=seq.index,
        )

    def beam_outputs(self, group: SequenceGroup) -> list[RequestOutput]:
        """One finished output per returned hypothesis of an ended beam search, best first (index 0)."""
        outputs = []
        for index, hyp in enumerate(group.beam.results()):
            tokens = list(hyp.token_ids)
            stopped = bool(tokens) and tokens[-1] == self.eos_token_id
            text = self.tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=True)
            outputs.append(
                RequestOutput(
                    request_id=group.parent.group_id,
                    new_token_ids=tokens,
                    text=text,
                    finished=True,
                    finish_reason="stop" if stopped else "length",
                    prompt_tokens=group.parent.num_prompt_tokens,
                    completion_tokens=len(tokens),
                    stop_reason=self.eos_token_id if stopped else None,
                    index=index,
                    score=hyp.score,
                )
            )
        return outputs
