"""Builds the step's tensors, runs the decoder, samples (the only tensor code of the engine)."""

from __future__ import annotations

import torch

from decoder_svc.core.outputs import ModelRunnerOutput
from decoder_svc.core.sampler import Sampler, SamplingRow
from decoder_svc.core.scheduler import SchedulerOutput
from kernels.attention_backend import make_attention_backend
from shared.attention_metadata import AttentionMetadata
from shared.device import model_device
from shared.models.linear import products_dtype


def self_cache_dtype(device: torch.device, weight_dtype: torch.dtype, cross_dtype: torch.dtype) -> torch.dtype:
    """The self-attention KV cache's dtype: the cross pool's on a GPU; on the CPU float32 (the decode-step kernels'
    dtype; attention upcasts a float16 / bfloat16 cross pool), bfloat16 for a model with bfloat16 products
    (``--dtype bfloat16``, ``shared.models.linear.products_dtype``: KV in bfloat16)."""
    if device.type != "cpu":
        return cross_dtype
    return torch.bfloat16 if weight_dtype == torch.bfloat16 else torch.float32


class ModelRunner:
    """Owns the self-attention KV cache; reads a caller-owned cross-attention KV cache.

    Args:
        model: decoder model with ``forward(input_ids, positions, attn_metadata,
            self_kv_cache, cross_kv_cache) -> [T, d]`` and ``compute_logits``,
            and ``config`` (``decoder_layers``, ``num_heads``, ``head_dim``).
        cross_kv_cache: ``[num_layers, 2, num_cross_blocks, block_size, H, Dh]``,
            filled by the encoder service (in production a view of shared memory
            or of a CUDA IPC pool; never allocated here). It must be on the
            model's device: the self cache and every step's tensors are put
            there too, and the logits are sampled there.
        num_self_blocks: blocks of the self-attention KV cache allocated here.
        block_size: tokens per block (both caches).
        sampler: picks tokens from logits.
        attention_backend: ``torch`` or ``triton``; the model's attention call
            sites call it (``kernels.attention_backend``), made and checked here.

    Raises:
        ValueError: bad cache layout, or an attention backend this machine
            cannot run.
    """

    def __init__(
        self,
        model,
        cross_kv_cache: torch.Tensor,
        num_self_blocks: int,
        block_size: int,
        sampler: Sampler,
        attention_backend: str = "torch",
    ) -> None:
        self.attn_backend = make_attention_backend(attention_backend, cross_kv_cache.device)
        c = model.config
        expected = (c.decoder_layers, 2, cross_kv_cache.shape[2], block_size, c.num_heads, c.head_dim)
        if tuple(cross_kv_cache.shape) != expected:
            raise ValueError(
                f"cross_kv_cache shape {tuple(cross_kv_cache.shape)} != expected "
                f"[num_layers, 2, num_blocks, block_size, H, Dh] = {list(expected)}"
            )
        self.model = model
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.sampler = sampler
        self.device = model_device(model)
        if cross_kv_cache.device != self.device:
            raise ValueError(
                f"cross_kv_cache is on {cross_kv_cache.device} but the model's weights are on {self.device}: "
                "attention reads the cache in place, so put both on one device (device / kv_device settings)"
            )
        self.cross_kv_cache = cross_kv_cache
        self.self_kv_cache = torch.zeros(  # [L, 2, num_self_blocks, block_size, H, Dh]
            c.decoder_layers,
            2,
            num_self_blocks,
            block_size,
            c.num_heads,
            c.head_dim,
            dtype=self_cache_dtype(self.device, products_dtype(model), cross_kv_cache.dtype),
            device=self.device,
        )

    def prepare_inputs(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat varlen batch: ``input_ids [T]``, ``positions [T]`` and the attention metadata."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        cross_tables: list[list[int]] = []
        encoder_lens: list[int] = []
        for seq, n in zip(so.scheduled_seqs, so.num_scheduled_tokens):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            block_tables.append(table)
            cross_tables.append(seq.cross_block_ids)
            encoder_lens.append(seq.encoder_len)

        def padded(rows: list[list[int]]) -> torch.Tensor:
            width = max((len(r) for r in rows), default=0)
            return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device).view(
                len(rows), width
            )

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long, device=self.device)

        qsl = t(query_start_loc)
        spans = []
        for b, ids in enumerate(cross_tables):
            if not ids or ids[-1] - ids[0] != len(ids) - 1 or ids != list(range(ids[0], ids[-1] + 1)):
                spans = None
                break
            spans.append((query_start_loc[b], query_start_loc[b + 1], ids[0] * bs, encoder_lens[b]))
        md = AttentionMetadata(
            query_start_loc=qsl,
            slot_mapping=t(slot_mapping),
            seq_lens=t(seq_lens),
            block_tables=padded(block_tables),
            cross_block_tables=padded(cross_tables),
            encoder_lens=t(encoder_lens),
            logits_indices=qsl[1:] - 1,
            max_query_len=max(so.num_scheduled_tokens, default=0),
            max_seq_len=max(seq_lens, default=0),
            max_encoder_len=max(encoder_lens, default=0),
            cross_kv_spans=spans,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.prepare(md)  # the step's attention plan, once for every layer
        return t(input_ids), t(positions), md

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: per scheduled sequence, in order, its sampled token id and what the sampler
        computed with it (logprobs, extra samples, beam log-probabilities; ``ModelRunnerOutput``)."""
        if so.is_empty:
            return ModelRunnerOutput()
        input_ids, positions, md = self.prepare_inputs(so)
        hidden = self.model.forward(input_ids, positions, md, self.self_kv_cache, self.cross_kv_cache)  # [T, d]
        probes = self._probe_rows(so, md)  # (seq id, flat row) of prompt positions asked for (Whisper)
        picked = (
            md.logits_indices
            if not probes
            else torch.cat([md.logits_indices, md.logits_indices.new_tensor([r for _, r in probes])])
        )
        logits = self.model.compute_logits(hidden[picked])  # [B (+ probes), V] float32
        probe_logits = {sid: logits[len(so.scheduled_seqs) + j].clone().cpu() for j, (sid, _) in enumerate(probes)}
        logits = logits[: len(so.scheduled_seqs)]
        rows = [SamplingRow.from_sequence(s) for s in so.scheduled_seqs]
        sampled = self.sampler(logits, rows)  # on the model's device (per-request generators live there)
        return ModelRunnerOutput(
            probe_logits=probe_logits,
            seq_ids=[s.request_id for s in so.scheduled_seqs],
            sampled_token_ids=sampled.sampled_token_ids,
            logprobs=sampled.logprobs,
            extra_token_ids=sampled.extra_token_ids,
            beam_logprobs=sampled.beam_logprobs,
            failed=sampled.failed,
        )

    @staticmethod
    def _probe_rows(so: SchedulerOutput, md: AttentionMetadata) -> list[tuple[str, int]]:
        """Flat-batch rows of the prompt positions this step computes that a sequence asked the logits of
        (``SamplingParams.probe_position``), as ``(seq id, row)``."""
        probes = []
        start = 0
        for seq, n in zip(so.scheduled_seqs, so.num_scheduled_tokens):
            pos = seq.sampling_params.probe_position
            first = seq.num_computed_tokens
            if pos is not None and first <= pos < first + n and pos < seq.num_prompt_tokens:
                probes.append((seq.request_id, start + pos - first))
            start += n
        return probes

    @torch.inference_mode()
    def gather_cross(self, block_ids: list[int], encoder_len: int) -> torch.Tensor:
        """``[L, 2, encoder_len, H, Dh]``: one sequence's cross KV copied out of its blocks."""
        cache = self.cross_kv_cache  # [L, 2, num_blocks, block_size, H, Dh]
        idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        kv = cache[:, :, idx]  # [L, 2, nb, block_size, H, Dh]
        return kv.reshape(kv.shape[0], 2, -1, *kv.shape[4:])[:, :, :encoder_len].clone()

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write after a fork: self KV block ``dst`` := block ``src``, every layer, K and V.

        Args:
            copies: ``(src, dst)`` self block id pairs (``Scheduler.fork`` /
                ``BlockManager.fork``); nothing to do when empty.
        """
        if not copies:
            return
        cache = self.self_kv_cache  # [L, 2, num_blocks, block_size, H, Dh]
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=cache.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=cache.device)
        cache[:, :, dst] = cache[:, :, src]
