"""Encoder-only models for Embed / Rerank / Classify / Tokenize: tokenize, one
packed forward over many sequences, pool or score. No KV cache.

Input contracts (each one documented in README.md, "Embed"):

- an empty or whitespace-only text is a valid item: it tokenizes to the special
  tokens alone (``[CLS] [SEP]``) and is embedded as such, like
  sentence-transformers; it never fails the request or changes other items;
- any Unicode (emoji, CJK) goes through the model's own tokenizer (BERT's
  WordPiece maps unknown symbols to ``[UNK]``);
- a sequence longer than ``max_input_length`` (special tokens included) fails
  the request with INVALID_ARGUMENT naming its index, length and the limit,
  unless ``truncate`` is set, which cuts every item (pairs longest-first);
- a text longer than ``max_input_chars`` (``max_input_length`` x
  ``tokenizing.MAX_CHARS_PER_TOKEN``) is refused the same way before any
  tokenizer work, or cut to that many characters first with ``truncate``
  (``encoder_svc.embed.tokenizing``);
- token ids (``EmbedRequest.input_ids``, OpenAI's ``input`` as lists of ids) are
  used as given, as vLLM and TEI do: no special tokens are added, token type ids
  are 0, each id must lie in ``[0, vocab_size)`` and each list hold at least one;
  an over-long list fails as an over-long text does, or with ``truncate`` keeps
  its first ``max_input_length`` ids (``EmbedEngine.encode_ids``). They enter as
  the ``Encoded`` sequences the tokenizer gives for texts, so the ids of
  ``tokenizer(text)`` embed bit for bit as ``text`` does in the same forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from encoder_svc.embed.tokenizing import BoundedTokenizer, Encoded
from shared.device import model_device
from shared.errors import InvalidRequestError
from shared.models.bert import BertEncoderModel, PackedBatch
from shared.models.embedding_config import EmbeddingSpec, read_embedding_spec

__all__ = ["EmbedEngine", "Encoded", "finish_embedding", "label_scores", "load_embed_engine"]

log = logging.getLogger(__name__)


class EmbedEngine:
    """A loaded encoder-only model with its tokenizer and embedding defaults.

    Args:
        model: a ``BertEncoderModel`` (or subclass) in eval mode, on the device
            it runs on; each batch's tensors are built there.
        tokenizer: the checkpoint's HF tokenizer.
        spec: pooling / normalise / max length defaults.
    """

    def __init__(self, model: BertEncoderModel, tokenizer, spec: EmbeddingSpec) -> None:
        self.model = model
        self.device = model_device(model)
        self.tokenizer = tokenizer
        self.spec = spec
        limits = [model.max_seq_len]
        if spec.max_seq_length:
            limits.append(spec.max_seq_length)
        tok_max = getattr(tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
            limits.append(tok_max)
        self.max_input_length = min(limits)
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self.num_labels = model.num_labels
        cfg = model.config
        self.labels = [cfg.id2label.get(i, f"LABEL_{i}") for i in range(self.num_labels)]
        self.multi_label = cfg.problem_type == "multi_label_classification" or self.num_labels == 1
        self._tokenizer = BoundedTokenizer(tokenizer, self.max_input_length, model.config.type_vocab_size > 1 or None)
        self.max_input_chars = self._tokenizer.max_input_chars

    @classmethod
    def load(
        cls,
        path: str | Path,
        model_class: type[BertEncoderModel],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> EmbedEngine:
        """Loads a sentence-transformers or HF-format directory; the model runs on ``device``.

        Raises:
            ValueError: unsupported pooling config; as ``model_class.from_pretrained``.
        """
        from transformers import AutoTokenizer

        spec = read_embedding_spec(path)
        model = model_class.from_pretrained(spec.transformer_dir, dtype=dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(str(spec.transformer_dir), local_files_only=True)
        return cls(model, tokenizer, spec)

    # ---- tokenization --------------------------------------------------------------------------

    def tokenize(
        self,
        texts: list[str],
        pairs: list[str | None] | None = None,
        truncate: bool = False,
        add_special_tokens: bool = True,
        check_length: bool = True,
        offsets: bool = False,
        max_total_tokens: int | None = None,
        names: tuple[str, str] = ("input {i}", "the text_pair of input {i}"),
    ) -> list[Encoded]:
        """Tokenizes texts (and optional second segments), keeping input order, within the bounds of
        ``encoder_svc.embed.tokenizing`` (characters per text, chunked calls, linear pair truncation).

        Raises:
            InvalidRequestError: an item is longer than ``max_input_chars`` characters, or
                (``check_length``) than ``max_input_length`` tokens, while ``truncate`` is off.
            ResourceExhaustedError: more than ``max_total_tokens`` tokens in all.
        """
        return self._tokenizer.tokenize(
            texts, pairs, truncate, add_special_tokens, check_length, offsets, max_total_tokens, names
        )

    def encode_ids(
        self, ids: Sequence[Sequence[int]], truncate: bool = False, name: str = "input_ids"
    ) -> list[Encoded]:
        """Token id lists as the engine's sequences, used as given (no special tokens added).

        Args:
            ids: per input, its whole sequence of token ids (int).
            truncate: keep the first ``max_input_length`` ids of a longer list instead of refusing it;
                only the ids kept are checked against the vocabulary.
            name: the request field, as errors name it (``input_ids[i]``).
        Returns:
            One ``Encoded`` per list, in order: the ids, token type ids all 0 (None when the model's
            tokenizer gives none, which the forward reads as 0).
        Raises:
            InvalidRequestError: a list is empty, holds an id outside ``[0, vocab_size)``, or is longer
                than ``max_input_length`` while ``truncate`` is off.
        """
        limit, vocab = self.max_input_length, self.vocab_size
        with_types = self._tokenizer.with_type_ids
        out = []
        for i, given in enumerate(ids):
            if not given:
                raise InvalidRequestError(f"{name}[{i}] is empty; send at least one token id")
            if len(given) > limit and not truncate:
                raise InvalidRequestError(
                    f"{name}[{i}] has {len(given)} tokens, more than this model's limit of {limit}; "
                    "shorten it or set truncate=true"
                )
            seq = list(given[:limit])  # copies only the ids kept
            if min(seq) < 0 or max(seq) >= vocab:  # C-speed scan; locate the bad id only on failure
                j, bad = next((j, t) for j, t in enumerate(seq) if not 0 <= t < vocab)
                raise InvalidRequestError(
                    f"{name}[{i}] holds token id {bad} (at position {j}), outside this model's vocabulary [0, {vocab})"
                )
            out.append(Encoded(seq, [0] * len(seq) if with_types else None))
        return out

    # ---- forward -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, seqs: list[Encoded], poolings: list[str]) -> list[torch.Tensor]:
        """Runs one packed forward over ``seqs``; one output per sequence.

        Args:
            poolings: per sequence, ``cls`` / ``mean`` / ``last`` (a ``[hidden]``
                vector) or ``logits`` (``[num_labels]``).
        Returns:
            float32 CPU tensors, unnormalised.
        """
        batch = PackedBatch.from_lists([s.ids for s in seqs], [s.type_ids for s in seqs]).to(self.device)
        hidden = self.model(batch)  # [T, hidden]
        starts = batch.starts  # [B]
        lens = torch.tensor(batch.seq_lens, dtype=torch.long, device=self.device)  # [B]
        wanted = set(poolings)
        pooled: dict[str, torch.Tensor] = {}
        if "cls" in wanted:
            pooled["cls"] = hidden[starts]  # [B, hidden]
        if "last" in wanted:
            pooled["last"] = hidden[starts + lens - 1]
        if "mean" in wanted:
            seq_idx = torch.repeat_interleave(torch.arange(len(seqs), device=self.device), lens)  # [T]
            sums = hidden.new_zeros(len(seqs), hidden.shape[1]).index_add_(0, seq_idx, hidden)
            pooled["mean"] = sums / lens[:, None].to(hidden.dtype)
        if "logits" in wanted:
            pooled["logits"] = self.model.classify(hidden, starts)  # [B, num_labels]
        pooled = {k: v.float().cpu() for k, v in pooled.items()}  # one device-to-host copy per pooling (no-op on CPU)
        return [pooled[p][i] for i, p in enumerate(poolings)]


def finish_embedding(vector: torch.Tensor, normalize: bool, dimensions: int) -> torch.Tensor:
    """Keeps the first ``dimensions`` values (0 = all), then L2-normalises if asked.

    Normalisation as ``torch.nn.functional.normalize`` (what sentence-transformers'
    ``Normalize`` module uses): ``v / max(||v||, 1e-12)``.
    """
    if dimensions:
        vector = vector[:dimensions]
    if normalize:
        vector = F.normalize(vector, p=2, dim=0)
    return vector


def label_scores(logits: torch.Tensor, multi_label: bool, raw: bool) -> torch.Tensor:
    """``[num_labels]`` scores: logits if ``raw``, else sigmoid (multi-label or one label) or softmax."""
    if raw:
        return logits
    return torch.sigmoid(logits) if multi_label else torch.softmax(logits, dim=-1)


def load_embed_engine(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> EmbedEngine:
    """Resolves a model name or directory through the registry and loads it for Embed on ``device``.

    Raises:
        ModelNotFoundError: as ``resolve_model``. ValueError: not an encoder-only model.
    """
    from shared.models.registry import is_encoder_only, model_class, resolve_model

    arch, path = resolve_model(name_or_path)
    if not is_encoder_only(name_or_path):
        raise ValueError(f"{name_or_path!r} is a {arch} model, not an encoder-only one")
    return EmbedEngine.load(path, model_class(arch), dtype, device)
