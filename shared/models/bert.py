"""BERT encoder (bidirectional, no KV cache) over packed sequences, with optional
pooler and ``BertForSequenceClassification`` head.

Packed layout: the sequences of a batch are concatenated into ``[T]`` tokens
(``T = sum(seq_lens)``); every linear layer runs on ``[T, hidden]`` so padding
costs nothing there. Only attention pads, into ``[B, H, S_max, D]``, and masks
padded keys. Reference: HF ``transformers.models.bert.modeling_bert`` (weights
and numerics), which this module must match within float tolerance.

Over 300 lines: one model per file (config, packed batch, embeddings, packed attention,
layers, pooler and classifier heads and the weight map together).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass(frozen=True)
class BertConfig:
    """The fields of an HF BERT / RoBERTa ``config.json`` this encoder uses.

    Attributes:
        position_offset: added to each token's position (RoBERTa: ``pad_token_id + 1``).
        id2label: label names of a sequence-classification head, by id.
        problem_type: HF's ``problem_type`` (``multi_label_classification`` picks sigmoid scores).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_offset: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    problem_type: str | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the position table allows (special tokens included)."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, d: dict, position_offset: int = 0) -> BertConfig:
        """Builds from a parsed ``config.json``.

        Raises:
            ValueError: an unsupported ``position_embedding_type`` or ``hidden_act``.
        """
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type {d['position_embedding_type']!r} is not supported (absolute only)"
            )
        if d.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; one of {', '.join(_ACTIVATIONS)}")
        id2label = {int(k): str(v) for k, v in (d.get("id2label") or {}).items()}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            hidden_act=d.get("hidden_act", "gelu"),
            max_position_embeddings=d.get("max_position_embeddings", 512),
            type_vocab_size=d.get("type_vocab_size", 2),
            layer_norm_eps=d.get("layer_norm_eps", 1e-12),
            pad_token_id=d.get("pad_token_id") or 0,
            position_offset=position_offset,
            id2label=id2label,
            problem_type=d.get("problem_type"),
        )


@dataclass
class PackedBatch:
    """Token tensors of several sequences laid end to end, and the lengths to undo it.

    Attributes:
        input_ids: ``[T]`` int64.
        token_type_ids: ``[T]`` int64 (zeros when the tokenizer gives none).
        seq_lens: length of each sequence, ``B`` ints, each >= 1.
    """

    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    seq_lens: list[int]

    @classmethod
    def from_lists(cls, ids: list[list[int]], type_ids: list[list[int] | None]) -> PackedBatch:
        flat_ids = [t for seq in ids for t in seq]
        flat_types = [t for seq, types in zip(ids, type_ids) for t in (types if types is not None else [0] * len(seq))]
        return cls(
            torch.tensor(flat_ids, dtype=torch.long), torch.tensor(flat_types, dtype=torch.long), [len(s) for s in ids]
        )

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch with its token tensors on ``device`` (the model's); derived index tensors follow them."""
        return PackedBatch(self.input_ids.to(device), self.token_type_ids.to(device), self.seq_lens)

    @property
    def starts(self) -> torch.Tensor:
        """Offset of each sequence's first token in ``[T]``, ``[B]`` int64, on the batch's device."""
        lens = torch.tensor(self.seq_lens, dtype=torch.long, device=self.input_ids.device)
        return torch.cumsum(lens, 0) - lens

    def positions(self) -> torch.Tensor:
        """Position of each token within its own sequence, ``[T]`` int64, on the batch's device."""
        device = self.input_ids.device
        lens = torch.tensor(self.seq_lens, dtype=torch.long, device=device)
        total = sum(self.seq_lens)
        return torch.arange(total, device=device) - torch.repeat_interleave(self.starts, lens)


class BertEmbeddings(nn.Module):
    """word + position (+ ``position_offset``) + token type, then LayerNorm."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        positions = batch.positions() + self.cfg.position_offset  # [T]
        x = self.word_embeddings(batch.input_ids) + self.token_type_embeddings(batch.token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))  # [T, hidden]


class AttentionLayout:
    """Index maps between packed ``[T]`` and padded ``[B, S_max]``, built once per forward."""

    def __init__(self, seq_lens: list[int], device: torch.device | str = "cpu") -> None:
        self.num_seqs = len(seq_lens)
        self.max_len = max(seq_lens)
        self.padded = any(n != self.max_len for n in seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        self.batch_idx = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), lens)  # [T]
        self.pos_idx = PackedBatch(torch.empty(0, device=device), torch.empty(0), seq_lens).positions()  # [T]
        # Key mask [B, 1, 1, S]: True where a real token sits.
        self.key_mask = (
            (torch.arange(self.max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
            if self.padded
            else None
        )


def packed_attention(qkv: torch.Tensor, layout: AttentionLayout, num_heads: int) -> torch.Tensor:
    """Bidirectional attention of each sequence over its own tokens.

    Args:
        qkv: ``[T, 3, H, D]`` fused projections.
        layout: from the batch's ``seq_lens``.
    Returns:
        ``[T, H * D]``.
    """
    T, _, H, D = qkv.shape
    B, S = layout.num_seqs, layout.max_len
    if layout.padded:
        padded = qkv.new_zeros(B, S, 3, H, D)
        padded[layout.batch_idx, layout.pos_idx] = qkv
    else:
        padded = qkv.view(B, S, 3, H, D)
    q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask)  # [B, H, S, D]
    out = out.transpose(1, 2)  # [B, S, H, D]
    if layout.padded:
        return out[layout.batch_idx, layout.pos_idx].reshape(T, H * D)
    return out.reshape(T, H * D)


class BertLayer(nn.Module):
    """Post-norm transformer layer: attention, add & norm, GELU MLP, add & norm."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)  # rows: query, key, value (fused at load)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(h, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        T, h = x.shape
        qkv = self.qkv(x).view(T, 3, self.num_heads, h // self.num_heads)  # [T, 3, H, D]
        x = self.attn_norm(x + self.attn_out(packed_attention(qkv, layout, self.num_heads)))
        return self.out_norm(x + self.output(self.act(self.intermediate(x))))  # [T, hidden]


class BertEncoderModel(nn.Module):
    """BERT trunk plus whatever heads the checkpoint has (pooler, classifier).

    ``forward`` gives the last hidden state of every token; ``classify`` turns
    it into ``[B, num_labels]`` logits when the checkpoint has a
    sequence-classification head.
    """

    PREFIXES = ("bert.",)  # stripped from checkpoint names (BertFor* wrappers)

    def __init__(self, cfg: BertConfig, has_pooler: bool = False, num_labels: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size) if has_pooler or num_labels else None
        self.num_labels = num_labels
        self.classifier = nn.Linear(cfg.hidden_size, num_labels) if num_labels else None

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Last hidden states ``[T, hidden]`` of the packed batch."""
        layout = AttentionLayout(batch.seq_lens, batch.input_ids.device)
        x = self.embeddings(batch)
        for layer in self.layers:
            x = layer(x, layout)
        return x

    def classify(self, hidden: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Sequence-classification logits ``[B, num_labels]`` from the first token of each sequence.

        Raises:
            RuntimeError: the checkpoint has no classification head.
        """
        if self.classifier is None:
            raise RuntimeError("this checkpoint has no sequence-classification head")
        pooled = torch.tanh(self.pooler(hidden[starts]))  # [B, hidden]
        return self.classifier(pooled)

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def config_from_hf(cls, d: dict) -> BertConfig:
        return BertConfig.from_hf(d)

    @classmethod
    def _heads(cls, weights: dict[str, torch.Tensor]) -> dict:
        num_labels = weights["classifier.weight"].shape[0] if "classifier.weight" in weights else 0
        return {"has_pooler": "pooler.dense.weight" in weights, "num_labels": num_labels}

    def head_names(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.pooler is not None:
            out |= {"pooler.dense.weight": self.pooler.weight, "pooler.dense.bias": self.pooler.bias}
        if self.classifier is not None:
            out |= {"classifier.weight": self.classifier.weight, "classifier.bias": self.classifier.bias}
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> BertEncoderModel:
        """Loads an HF-format directory (``config.json`` + safetensors or ``pytorch_model.bin``),
        or the ``Transformer`` module's directory of a sentence-transformers one.

        Raises:
            FileNotFoundError: no weights. KeyError / ValueError: a missing
                parameter or a shape mismatch (see ``load_weights``).
        """
        from shared.models.embedding_config import find_transformer_dir
        from shared.models.hf_checkpoint import load_hf_weights

        path = find_transformer_dir(Path(path))
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
        weights = {cls._strip(k): v for k, v in load_hf_weights(path).items()}
        model = cls(cls.config_from_hf(hf), **cls._heads(weights))
        model.load_weights(weights)
        return model.to(dtype).eval()

    @classmethod
    def _strip(cls, name: str) -> str:
        for prefix in cls.PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix) :]
        return name

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies HF-named tensors (wrapper prefix already stripped) onto this model.

        Old checkpoints' ``LayerNorm.gamma`` / ``beta`` are accepted for ``weight`` / ``bias``.

        Raises:
            KeyError: a parameter is missing. ValueError: a shape differs.
        """
        e = self.embeddings
        name_map: dict[str, torch.Tensor] = {
            "embeddings.word_embeddings.weight": e.word_embeddings.weight,
            "embeddings.position_embeddings.weight": e.position_embeddings.weight,
            "embeddings.token_type_embeddings.weight": e.token_type_embeddings.weight,
            "embeddings.LayerNorm.weight": e.LayerNorm.weight,
            "embeddings.LayerNorm.bias": e.LayerNorm.bias,
            **self.head_names(),
        }
        fused: list[tuple[str, torch.Tensor, str]] = []
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}"
            for kind in ("weight", "bias"):
                fused.append((f"{p}.attention.self.{{}}.{kind}", getattr(layer.qkv, kind), kind))
                name_map |= {
                    f"{p}.attention.output.dense.{kind}": getattr(layer.attn_out, kind),
                    f"{p}.attention.output.LayerNorm.{kind}": getattr(layer.attn_norm, kind),
                    f"{p}.intermediate.dense.{kind}": getattr(layer.intermediate, kind),
                    f"{p}.output.dense.{kind}": getattr(layer.output, kind),
                    f"{p}.output.LayerNorm.{kind}": getattr(layer.out_norm, kind),
                }
        with torch.no_grad():
            for name, dst in name_map.items():
                _copy(dst, _get(weights, name), name)
            for pattern, dst, _ in fused:
                parts = [_get(weights, pattern.format(n)) for n in ("query", "key", "value")]
                _copy(dst, torch.cat(parts, 0), pattern.format("{query,key,value}"))


_LEGACY_NORM = {".weight": ".gamma", ".bias": ".beta"}


def _get(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name in weights:
        return weights[name]
    if "LayerNorm" in name:
        for new, old in _LEGACY_NORM.items():
            if name.endswith(new) and name[: -len(new)] + old in weights:
                return weights[name[: -len(new)] + old]
    raise KeyError(f"checkpoint lacks parameter {name!r}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))
