"""The decoder engine: one ``step()`` = ``schedule()``, ``execute_model()``, ``update_from_output()``, output stage.

Single-threaded; the gRPC layer wraps it in a thread. Cross-attention KV is
filled from outside: each step lists in ``to_encode`` the requests whose cross
blocks were just reserved, the owner has the encoder service write their
cross KV at those block ids, then calls ``mark_encoded``.

One step, as vLLM v1's engine core:

1. ``Scheduler.schedule`` plans the batch (``SchedulerOutput``);
2. ``ModelRunner.execute_model`` runs the decoder and samples
   (``ModelRunnerOutput``: tokens, logprobs, extra samples, beam log-probabilities);
3. n > 1 samples are forked off their prompt step (``SequenceGroups.fork_samples``),
   then ``Scheduler.update_from_output`` appends the tokens and finishes
   sequences on stop token ids and lengths;
4. the output stage (``OutputProcessor``) detokenizes, ends sequences on stop
   strings and builds the ``RequestOutput``s; beam groups then take their
   search step (``SequenceGroups.step_beams``) and an ended search outputs its beams.

Fault isolation (``decoder_svc.core.step_failures``): an exception raised while the
step handles one request's own rows (its sampling, forks, beam step,
detokenization) ends that request alone: its blocks are freed within the step,
its rows leave the rest of the step, and its last ``RequestOutput`` carries the
``error`` it ends with. Anything else (the model forward) still fails the step.

Several sequences per request (``SamplingParams.n`` / ``num_beams``):
``decoder_svc.core.sequence_group``. ``abort`` frees every sequence of the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from decoder_svc.core.block_manager import BlockManager
from decoder_svc.core.model_runner import ModelRunner
from decoder_svc.core.output_processor import OutputProcessor
from decoder_svc.core.outputs import ModelRunnerOutput, RequestOutput, StepOutput
from decoder_svc.core.sampler import Sampler
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.core.scheduler import CapacityError, Scheduler
from decoder_svc.core.scheduler_output import SchedulerOutput
from decoder_svc.core.sequence import Sequence, sample_seq_id
from decoder_svc.core.sequence_group import SequenceGroup, SequenceGroups
from decoder_svc.core.step_failures import StepFailures

if TYPE_CHECKING:
    import torch

__all__ = ["CapacityError", "DecoderEngine", "RequestOutput", "StepOutput"]


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
        self.sampler = Sampler(
            gen.suppress_tokens,
            gen.begin_suppress_tokens,
            getattr(gen, "forced_bos_token_id", None),
            getattr(gen, "forced_eos_token_id", None),
        )
        self.model_runner = ModelRunner(
            model, cross_kv_cache, num_self_blocks, block_size, self.sampler, attention_backend
        )
        self.sequence_groups = SequenceGroups(
            self.scheduler, self.model_runner.copy_blocks, self.eos_token_id, self.max_total_len
        )
        self.output_processor = OutputProcessor(tokenizer, self.scheduler, self.eos_token_id, self._release)
        self.num_encoded = 0  # successful mark_encoded calls (the engine loop's holds watch it for encoder progress)
        self.num_model_steps = 0  # steps that ran the model (a batch of >= 1 sequence)
        self.num_step_sequences = 0  # sequences over those steps (their mean batch = this / num_model_steps)

    def add_request(
        self,
        request_id: str,
        encoder_len: int,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        encoder_cache_key: str | None = None,
        keep_cross: bool = False,
        reuse_cross: bool = False,
        arrival_order: int | None = None,
    ) -> None:
        """Queues a request; its cross blocks are reserved at a later ``step()``.

        Args:
            encoder_len: cross-attention KV length (1500 for Whisper's 30 s window;
                the source token count for text models).
            prompt_token_ids: decoder prompt; default ``model.generation.decoder_prompt_ids``.
            priority: lower value = scheduled earlier; ties first come first served
                (``decoder_svc.core.scheduler``).
            encoder_cache_key: content key of the encoder input
                (``decoder_svc.core.encoder_cache``): while another unfinished request
                with this key holds cross KV, this one shares it and is never
                listed in ``to_encode``. None: always encoded.
            keep_cross: when it finishes (not aborted) its cross blocks stay
                reserved under ``request_id`` (``decoder_svc.core.request_queues``): for
                another sequence of the same request over the same encoder output
                (Whisper's fallback, language detection) or ``cross_kv``. With n > 1
                samples the first one (``request_id`` itself) keeps them; the others
                hold their own references until they finish.
            reuse_cross: read the cross blocks kept under ``request_id``: never in
                ``to_encode``, runnable at once.
            arrival_order: its place among equal priorities
                (``decoder_svc.core.sequence.next_arrival_order``); None: now. A request of
                several sequences in turn (Whisper's windows) keeps its first, so it is
                served first come first served as a whole (vLLM's FCFS), not behind every
                request that arrived while its previous window ran.

        Raises:
            CapacityError: it can never fit the KV pools / batch token limit (with
                n > 1 or beams: its ``max(n, num_beams)`` sequences at max length
                must fit the self pool and ``max_num_seqs`` together).
            ValueError: duplicate request id, bad encoder_len, prompt or stop_token_ids;
                keep_cross / reuse_cross with beam search.
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
        width = max(params.n, params.num_beams)
        if (
            request_id in self.scheduler.requests
            or request_id in self.groups
            or any(sample_seq_id(request_id, i) in self.scheduler.requests for i in range(1, width))
        ):
            raise ValueError(f"duplicate request id {request_id!r}")
        seq = Sequence(
            request_id, prompt, encoder_len, params, self.eos_token_id, self.max_total_len, priority, arrival_order
        )
        if width > 1:
            self.sequence_groups.check_capacity(seq, width)
        if (keep_cross or reuse_cross) and params.num_beams > 1:
            raise ValueError("keep_cross / reuse_cross take num_beams = 1")
        self.scheduler.add(seq, encoder_cache_key, keep_cross=keep_cross, reuse_cross=reuse_cross)
        if width > 1:
            self.sequence_groups.add(seq)

    @property
    def groups(self) -> dict[str, SequenceGroup]:
        """Request id -> its samples / beams (requests with n > 1 or num_beams > 1; ``decoder_svc.core.sequence_group``)."""
        return self.sequence_groups.groups

    def step(self) -> StepOutput:
        """One engine iteration: schedule, run the decoder, apply the tokens, then the output stage.

        A request that fails on its own rows ends with an ``error`` output (module docstring).

        Raises:
            Exception: a failure not attributable to one request (the model forward, the batch tensors).
        """
        so = self.scheduler.schedule()
        out = self.model_runner.execute_model(so)
        if so.scheduled_seqs:
            self.num_model_steps += 1
            self.num_step_sequences += len(so.scheduled_seqs)
        failures = StepFailures()
        for s in so.scheduled_seqs:
            if s.request_id in out.failed:
                failures.add(s.group_id, "sampler", out.failed[s.request_id], s.sampling_params)
        so, out = self._drop_failed(so, out, failures)
        forked = self.sequence_groups.fork_samples(so, out, failures)  # before sample 0's token is appended
        so, out = self._drop_failed(so, out, failures)
        forked = [c for c in forked if c.group_id not in failures]
        finished = self.scheduler.update_from_output(so, out, forked)
        outputs = self.output_processor.process(so, out, forked, finished, failures)
        for group in self.sequence_groups.step_beams(so, out, failures):
            with failures.guard(group.parent.group_id, "output of its beams", group.parent.sampling_params):
                outputs.extend(self.output_processor.beam_outputs(group))
        if failures:
            self._drop_failed(so, out, failures)
            outputs = [o for o in outputs if o.request_id not in failures] + failures.outputs()
        return StepOutput(to_encode=[(s.request_id, list(s.cross_block_ids)) for s in so.to_encode], outputs=outputs)

    def _drop_failed(
        self, so: SchedulerOutput, out: ModelRunnerOutput, failures: StepFailures
    ) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Frees every sequence of the requests that failed so far this step; returns the step's plan and
        results without their rows (``StepFailures.without``)."""
        for request_id in failures.pending_aborts():
            self._abort_failed(request_id)
        return failures.without(so, out)

    def _abort_failed(self, request_id: str) -> None:
        """Frees every sequence of a failed request: its group's, and any the scheduler holds under its id
        (a fork cut short by the failure may not have joined the group yet)."""
        self.abort(request_id)
        for sid in [sid for sid, s in self.scheduler.requests.items() if s.group_id == request_id]:
            self.scheduler.abort(sid)
            self.sampler.release(sid)

    def _release(self, seq: Sequence) -> None:
        """A sample finished: forget its generator; the request's group goes with its last sample."""
        self.sampler.release(seq.request_id)
        self.sequence_groups.release(seq)

    def mark_encoded(self, request_id: str) -> bool:
        """The encoder has written ``request_id``'s cross KV; it may now be scheduled.

        Returns:
            False (and nothing changes) when the request is not waiting for its
            encoding, e.g. it was aborted while the encoder ran.
        """
        if request_id not in self.scheduler.encoding:
            return False
        self.scheduler.mark_encoded(request_id)
        self.num_encoded += 1
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
        group = self.sequence_groups.groups.pop(request_id, None)
        ids = [request_id] if group is None else [request_id, *group.seqs]
        existed = False
        for sid in dict.fromkeys(ids):
            existed = self.scheduler.abort(sid) or existed
            self.sampler.release(sid)
        return existed or group is not None

    def release_cross(self, request_id: str) -> bool:
        """Frees the cross blocks kept under ``request_id`` (``add_request(keep_cross=True)``); False if none."""
        return self.scheduler.release_cross(request_id)

    def cross_kv(self, request_id: str) -> torch.Tensor:
        """The cross-attention KV kept under ``request_id``, gathered densely:
        ``[num_layers, 2, encoder_len, H, Dh]`` (a copy, in the pool's dtype and device).

        Raises:
            KeyError: no cross KV is kept under ``request_id``.
        """
        block_ids, encoder_len = self.scheduler.kept_cross[request_id]
        return self.model_runner.gather_cross(block_ids, encoder_len)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_encoding(self) -> int:
        """Requests waiting for the encoder to write their cross KV (see ``mark_encoded``)."""
        return self.scheduler.num_encoding

    @property
    def num_ready(self) -> int:
        """Sequences a model step could take now: running, or encoded and waiting for a seat / self blocks."""
        return self.scheduler.num_running + self.num_to_prefill

    @property
    def num_to_prefill(self) -> int:
        """Encoded sequences waiting for a step to take them (their first, or a recompute after preemption)."""
        return len(self.scheduler.waiting)

    def is_encoding(self, request_id: str) -> bool:
        """True while ``request_id`` waits for the encoder to write its cross KV."""
        return request_id in self.scheduler.encoding

    def dispatch_encodes(self) -> StepOutput:
        """A step without the model: only reserves cross blocks for new requests (``to_encode``).

        The engine loop calls this instead of ``step`` while it holds decode
        steps for pending encodes (``decoder_svc.core.engine_loop``).
        """
        so = self.scheduler.reserve_cross()
        return StepOutput(to_encode=[(s.request_id, list(s.cross_block_ids)) for s in so.to_encode])

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
            "num_model_steps": self.num_model_steps,
            "num_step_sequences": self.num_step_sequences,
        }
