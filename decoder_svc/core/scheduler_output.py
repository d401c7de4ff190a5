"""What one scheduler step plans (vLLM v1 ``vllm/v1/core/sched/output.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from decoder_svc.core.sequence import Sequence


@dataclass
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled_seqs: sequences in batch order (decodes first, then prefills).
        num_scheduled_tokens: per scheduled sequence, its uncomputed tokens
            (``num_tokens - num_computed_tokens``; 1 for a decode step).
        to_encode: sequences whose cross blocks were just reserved; the owner
            asks the encoder to fill them and then calls ``mark_encoded``.
        preempted: sequences preempted this step.
    """

    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    to_encode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_seqs
