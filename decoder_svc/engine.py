"""The decoder engine: one ``step()`` = ``schedule()``, ``execute_model()``, ``update_from_output()``.

Single-threaded; the gRPC layer wraps it in a thread. Cross-attention KV is
filled from outside: each step lists in ``to_encode`` the requests whose cross
blocks were just reserved, the owner has the encoder service write their
cross KV at those block ids, then calls ``mark_encoded``.

Several sequences per request (``SamplingParams.n`` / ``num_beams``): the
request starts as one sequence (index 0, id = the request id); the others are
forked from it (``Scheduler.fork``: cross blocks and the prompt's full self
blocks shared by reference count, the partly filled block copied), so the
cross-attention KV is encoded and stored once per request.

* n > 1 samples: the prompt step draws n first tokens from the same scores
  (``decoder_svc.sampler``), samples 1..n-1 are forked with theirs, and each
  sample then runs, finishes and is preempted (recompute) on its own; every
  output carries its ``index``.
* Beam search (``decoder_svc.beam_search``): the running beams, as token
  tuples, map to sequences (equal tuples share one); each step the engine
  takes the processed log-probabilities of every live beam sequence, asks
  ``BeamSearch.step`` for the new beams and reorders sequences: a source with
  no successor is freed, its first successor appends the token in place, the
  others are forks. A group steps only when every one of its live sequences
  ran in the same engine step; otherwise (a beam preempted or waiting for a
  seat) that step's results of the group are dropped and the group's running
  members are preempted too (recompute), so the group is admitted again as a
  whole (all-or-nothing; its members share one queue place) and never holds
  seats another group's beams wait for. Results stay independent of batching
  and preemption. Nothing is output until the
  search ends; then one finished output per returned beam (index 0 = best)
  with all its tokens, text and ``score``.
* ``abort`` frees every sequence of the request.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from decoder_svc.beam_search import BeamSearch
from decoder_svc.block_manager import BlockManager
from decoder_svc.detokenizer import OutputText
from decoder_svc.model_runner import ModelRunner
from decoder_svc.sampler import Sampler, TokenLogprobs
from decoder_svc.scheduler import CapacityError, Scheduler
from decoder_svc.sequence import Sequence, sample_seq_id
from decoder_svc.sampling_params import SamplingParams

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
        index: which of the request's n samples / returned beams (0 = the best beam).
        score: beam search only: the hypothesis' HF score (sum of its token
            logprobs / generated_len ** length_penalty).
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


@dataclass
class _Group:
    """A request with several sequences: n > 1 samples or a beam search."""

    parent: Sequence
    beam: BeamSearch | None = None
    seqs: dict[str, Sequence] = field(default_factory=dict)  # live sequences by scheduler id
    beam_seqs: dict[tuple[int, ...], Sequence] = field(default_factory=dict)  # running beam tokens -> its sequence
    num_finished: int = 0


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
        self.groups: dict[str, _Group] = {}  # request id -> its samples / beams (n > 1 or num_beams > 1)
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
            CapacityError: it can never fit the KV pools / batch token limit (with
                n > 1 or beams: its ``max(n, num_beams)`` sequences at max length
                must fit the self pool and ``max_num_seqs`` together).
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
        width = max(params.n, params.num_beams)
        if request_id in self.scheduler.requests or request_id in self.groups or any(sample_seq_id(request_id, i) in self.scheduler.requests for i in range(1, width)):
            raise ValueError(f"duplicate request id {request_id!r}")
        seq = Sequence(request_id, prompt, encoder_len, params, self.eos_token_id, self.max_total_len, priority)
        seq.output_text = OutputText(self.tokenizer, params.stop, params.include_stop_str_in_output)
        if width > 1:
            self._check_group_capacity(seq, width)
        self.scheduler.add(seq, encoder_cache_key)
        if width > 1:
            group = self.groups[request_id] = _Group(seq, seqs={request_id: seq})
            if params.num_beams > 1:
                group.beam = BeamSearch(params.num_beams, params.n, params.length_penalty, params.early_stopping,
                                        (self.eos_token_id,), len(prompt), seq.max_len)
                group.beam_seqs[()] = seq

    def _check_group_capacity(self, seq: Sequence, width: int) -> None:
        """``width`` sequences of ``seq``'s max length must fit the batch and the self pool at once."""
        bm, sched = self.block_manager, self.scheduler
        if width > sched.max_num_seqs:
            raise CapacityError(f"request {seq.request_id!r}: {width} samples / beams exceed max_num_seqs {sched.max_num_seqs}")
        need = width * bm.num_blocks_for(max(seq.max_len - 1, seq.num_prompt_tokens))
        if need > bm.num_self_blocks:
            raise CapacityError(f"request {seq.request_id!r}: {width} samples / beams of max length {seq.max_len} need {need} "
                                f"self blocks of {bm.block_size} tokens, the self pool has {bm.num_self_blocks}")

    def step(self) -> StepOutput:
        """One engine iteration: schedule, run the decoder, append tokens and stream them."""
        so = self.scheduler.schedule()
        token_ids = self.model_runner.execute_model(so)
        if so.scheduled_seqs:
            self.num_model_steps += 1
            self.num_step_sequences += len(so.scheduled_seqs)
        logprobs = self.sampler.take_logprobs()
        extra = self.sampler.take_extra_samples()
        beam_logprobs = self.sampler.take_beam_logprobs()
        plain = [(s, t) for s, t in zip(so.scheduled_seqs, token_ids) if s.sampling_params.num_beams == 1]
        # n > 1: fork samples 1..n-1 off the prompt step before sample 0's token is appended (it may finish on it).
        children = [c for s, t in plain if s.group_id in self.groups and s.index == 0 and s.num_output_tokens == 0
                    for c in self._fork_samples(s, extra.get(s.request_id, [t] * (s.sampling_params.n - 1)))]
        # Appends the tokens; each sequence's check_stop detokenizes and matches stop strings.
        finished = self.scheduler.update_from_output([s.request_id for s, _ in plain], [t for _, t in plain])
        out = StepOutput(to_encode=[(s.request_id, list(s.cross_block_ids)) for s in so.to_encode])
        finished_ids = {s.request_id for s in finished}
        for child in children:
            status = child.check_stop()
            if status is not None:
                self.scheduler.abort(child.request_id)  # frees its blocks ...
                child.status = status  # ... and it finished for this reason
                finished_ids.add(child.request_id)
        for seq, tok in [*plain, *((c, c.output_token_ids[-1]) for c in children)]:
            out.outputs.append(self._make_output(seq, tok, seq.request_id in finished_ids, logprobs.get(seq.request_id)))
        for request_id in dict.fromkeys(s.group_id for s in so.scheduled_seqs if s.sampling_params.num_beams > 1):
            out.outputs.extend(self._beam_step(self.groups[request_id], beam_logprobs))
        return out

    def _new_sequence(self, parent: Sequence, index: int, output_token_ids: list[int]) -> Sequence:
        """A sibling of ``parent`` (same request, queue place and params) with id ``sample_seq_id(request, index)``."""
        child = Sequence(sample_seq_id(parent.group_id, index), parent.prompt_token_ids, parent.encoder_len,
                         parent.sampling_params, self.eos_token_id, self.max_total_len, parent.priority)
        child.group_id, child.arrival_order, child.arrival_time = parent.group_id, parent.arrival_order, parent.arrival_time
        child.output_token_ids = list(output_token_ids)
        return child

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """``Scheduler.fork`` plus its copy-on-write block copies (self KV block ``dst`` := ``src``, all layers)."""
        copies = self.scheduler.fork(parent.request_id, child)
        if copies:
            cache = self.model_runner.self_kv_cache  # [L, 2, num_blocks, block_size, H, Dh]
            src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=cache.device)
            dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=cache.device)
            with torch.inference_mode():
                cache[:, :, dst] = cache[:, :, src]
        self.groups[parent.group_id].seqs[child.request_id] = child

    def _fork_samples(self, parent: Sequence, first_tokens: list[int]) -> list[Sequence]:
        """Samples 1..n-1 of ``parent``'s request after its prompt step, each with its first token appended."""
        parent.num_computed_tokens = parent.num_tokens  # the prompt's K/V were written this step
        children = []
        for i, tok in enumerate(first_tokens, start=1):
            child = self._new_sequence(parent, i, [tok])
            child.index = i
            child.output_text = OutputText(self.tokenizer, parent.sampling_params.stop, parent.sampling_params.include_stop_str_in_output)
            self._fork(parent, child)
            children.append(child)
        return children

    def _beam_step(self, group: _Group, beam_logprobs: dict[str, torch.Tensor]) -> list[RequestOutput]:
        """One beam search step of ``group`` if all its live sequences ran this step (see the module docstring)."""
        live = list(dict.fromkeys(group.beam_seqs.values()))
        if not all(s.request_id in beam_logprobs for s in live):
            # Part of the group did not run: drop its results this step and send the whole group back to
            # the waiting queue, where its members share one place and are admitted together (beams of
            # two groups holding each other's seats would otherwise wait for each other forever).
            for s in live:
                self.scheduler.preempt(s.request_id)
            return []
        beam = group.beam
        for s in live:
            s.num_computed_tokens = s.num_tokens
        old = list(beam.running)
        new = beam.step(torch.stack([beam_logprobs[group.beam_seqs[t].request_id] for t in old]).float().cpu())
        if beam.done:
            return self._finish_beams(group)
        successors: dict[tuple[int, ...], Sequence] = {}  # new running tokens -> its source sequence
        for src, tok in new:
            successors.setdefault(old[src] + (tok,), group.beam_seqs[old[src]])
        used = {id(s) for s in successors.values()}
        for s in live:
            if id(s) not in used:
                self._drop(group, s)
        reused: set[int] = set()
        appends = []
        beam_seqs = {}
        for tokens, src in successors.items():
            if id(src) in reused:
                index = next(k for k in itertools.count(1) if sample_seq_id(group.parent.group_id, k) not in self.scheduler.requests)
                child = self._new_sequence(src, index, list(src.output_token_ids) + [tokens[-1]])
                self._fork(src, child)
                beam_seqs[tokens] = child
            else:
                reused.add(id(src))
                appends.append((src, tokens[-1]))
                beam_seqs[tokens] = src
        for src, tok in appends:
            src.append_token(tok)
        group.beam_seqs = beam_seqs
        return []

    def _drop(self, group: _Group, seq: Sequence) -> None:
        """Frees one sequence of a group (a beam with no successor, or the group ending)."""
        self.scheduler.abort(seq.request_id)
        group.seqs.pop(seq.request_id, None)

    def _finish_beams(self, group: _Group) -> list[RequestOutput]:
        """Frees the group's sequences; one finished output per returned hypothesis, best first."""
        for s in list(group.seqs.values()):
            self._drop(group, s)
        del self.groups[group.parent.group_id]
        outputs = []
        for index, hyp in enumerate(group.beam.results()):
            tokens = list(hyp.token_ids)
            stopped = bool(tokens) and tokens[-1] == self.eos_token_id
            text = self.tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=True)
            outputs.append(RequestOutput(
                request_id=group.parent.group_id, new_token_ids=tokens, text=text, finished=True,
                finish_reason="stop" if stopped else "length", prompt_tokens=group.parent.num_prompt_tokens,
                completion_tokens=len(tokens), stop_reason=self.eos_token_id if stopped else None,
                index=index, score=hyp.score))
        return outputs

    def _make_output(self, seq: Sequence, token_id: int, finished: bool, logprobs: TokenLogprobs | None) -> RequestOutput:
        if finished:
            self._release(seq)
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

    def _release(self, seq: Sequence) -> None:
        """A sample finished: forget its generator; the request's group goes with its last sample."""
        self.sampler.release(seq.request_id)
        group = self.groups.get(seq.group_id)
        if group is not None:
            group.seqs.pop(seq.request_id, None)
            group.num_finished += 1
            if group.num_finished == seq.sampling_params.n:
                del self.groups[seq.group_id]

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
        group = self.groups.pop(request_id, None)
        ids = [request_id] if group is None else [request_id, *group.seqs]
        existed = False
        for sid in dict.fromkeys(ids):
            existed = self.scheduler.abort(sid) or existed
            self.sampler.release(sid)
        return existed or group is not None

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
        steps for pending encodes (``decoder_svc.engine_loop``).
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
