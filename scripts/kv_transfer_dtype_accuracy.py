"""Measures what a float16 / bfloat16 cross-KV pool (``--kv-transfer-dtype``) costs in accuracy.

For every clip in encdec/data: HF greedy tokens (float32, the reference) against
our decoder engine over a cross-KV pool of each dtype (the encoder's float32
cross KV cast on write, exactly as the transports do), and the max absolute
logit difference of a teacher-forced pass over HF's tokens (ours vs HF).
Prints a markdown table (docs/kv_transport.md). Run from the repo root:
``.venv/bin/python scripts/kv_transfer_dtype_accuracy.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import soundfile as sf
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from helpers.paged_greedy import _Seq, build_metadata  # noqa: E402

from decoder_svc.core.engine import DecoderEngine  # noqa: E402
from encdec import DATA_DIR  # noqa: E402
from encdec.bench.hf_whisper import build_hf_whisper  # noqa: E402
from shared.kv_transport import write_blocks  # noqa: E402
from shared.kv_transport.base import DTYPES  # noqa: E402
from shared.models.registry import load_model, load_tokenizer, resolve_model  # noqa: E402
from shared.models.whisper_features import log_mel_spectrogram  # noqa: E402

BLOCK = 16


def engine_greedy(model, tokenizer, cross_kv: torch.Tensor, dtype: str) -> list[int]:
    """Greedy tokens (no prompt, no end token) of one clip through ``DecoderEngine`` over a ``dtype`` cross pool."""
    c = model.config
    enc_len = cross_kv.shape[2]
    n_cross = -(-enc_len // BLOCK)
    pool = torch.zeros(c.decoder_layers, 2, n_cross + 1, BLOCK, c.num_heads, c.head_dim, dtype=DTYPES[dtype])
    engine = DecoderEngine(model, tokenizer, pool, num_self_blocks=32, block_size=BLOCK, max_num_seqs=1)
    engine.add_request("r", enc_len)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        out = engine.step()
        for rid, blocks in out.to_encode:
            write_blocks(pool, blocks, cross_kv)
            engine.mark_encoded(rid)
        for o in out.outputs:
            tokens += o.new_token_ids
    return tokens[:-1] if tokens and tokens[-1] == model.generation.eos_token_id else tokens


def teacher_forced_logits(model, cross_kv: torch.Tensor, dtype: str, tokens: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` of one prefill over ``prompt + tokens`` with the cross KV stored as ``dtype``."""
    c = model.config
    enc_len = cross_kv.shape[2]
    n_cross = -(-enc_len // BLOCK)
    pool = torch.zeros(c.decoder_layers, 2, n_cross, BLOCK, c.num_heads, c.head_dim, dtype=DTYPES[dtype])
    write_blocks(pool, list(range(n_cross)), cross_kv)
    ids = list(model.generation.decoder_prompt_ids) + tokens
    n_self = -(-len(ids) // BLOCK)
    self_cache = torch.zeros(c.decoder_layers, 2, n_self, BLOCK, c.num_heads, c.head_dim)
    seq = _Seq(
        tokens=ids,
        prompt_len=len(ids),
        cross_blocks=list(range(n_cross)),
        start_step=0,
        self_blocks=list(range(n_self)),
    )
    input_ids, positions, md = build_metadata([seq], [len(ids)], enc_len, BLOCK)
    md.logits_indices = torch.arange(len(ids))
    hidden = model(input_ids, positions, md, self_cache, pool)
    return model.compute_logits(hidden)  # [T, V]


def main() -> None:
    torch.set_num_threads(2)
    model_dir = resolve_model("whisper-tiny.en")[1]
    model, tokenizer, hf = load_model(model_dir), load_tokenizer(model_dir), build_hf_whisper(model_dir)
    rows = []
    with torch.inference_mode():
        for wav in sorted((DATA_DIR).glob("*.wav")):
            pcm, _ = sf.read(wav, dtype="float32")
            feats = log_mel_spectrogram(pcm)[None]  # [1, 80, 3000]
            ref = hf.generate(feats).tolist()[0]
            prompt = list(model.generation.decoder_prompt_ids)
            hf_logits = hf(input_features=feats, decoder_input_ids=torch.tensor([prompt + ref])).logits[0]  # [T, V]
            cross_kv = model.compute_cross_kv(model.encode(feats))[:, :, 0]  # [L, 2, S, H, D]
            for dtype in ("float32", "float16", "bfloat16"):
                tokens = engine_greedy(model, tokenizer, cross_kv, dtype)
                logits = teacher_forced_logits(model, cross_kv, dtype, ref)
                rows.append(
                    (
                        wav.name,
                        dtype,
                        tokens == ref,
                        len(ref),
                        (logits - hf_logits).abs().max().item(),
                        (cross_kv - cross_kv.to(DTYPES[dtype]).float()).abs().max().item(),
                    )
                )
    print("| clip | pool dtype | greedy tokens == HF | tokens | max abs logit diff vs HF | max abs cross-KV rounding |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, dtype, equal, n, dl, dk in rows:
        print(f"| {name} | {dtype} | {'yes' if equal else 'NO'} | {n} | {dl:.2e} | {dk:.2e} |")


if __name__ == "__main__":
    main()
