"""RoBERTa and XLM-RoBERTa encoders, and their sequence-classification head.

The trunk is BERT's (``shared.models.bert``); what differs:

- position ids start at ``padding_idx + 1`` (HF ``create_position_ids_from_input_ids``:
  real tokens get ``padding_idx + 1 + i``), so the longest sequence is
  ``max_position_embeddings - padding_idx - 1`` (512 for the usual 514);
- one token type (``type_vocab_size`` 1); the tokenizer gives no ``token_type_ids``;
- the ``*ForSequenceClassification`` head is ``dense -> tanh -> out_proj`` on the
  first token's hidden state (HF ``RobertaClassificationHead``), with no pooler.

XLM-RoBERTa has the same architecture and weight names.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.models.bert import BertConfig, BertEncoderModel


class RobertaEncoderModel(BertEncoderModel):
    """RoBERTa / XLM-RoBERTa trunk plus an optional classification head."""

    PREFIXES = ("roberta.",)

    def __init__(self, cfg: BertConfig, has_pooler: bool = False, num_labels: int = 0) -> None:
        super().__init__(cfg, has_pooler=has_pooler, num_labels=0)
        self.num_labels = num_labels
        if num_labels:
            self.head_dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.classifier = nn.Linear(cfg.hidden_size, num_labels)  # HF: classifier.out_proj

    @classmethod
    def config_from_hf(cls, d: dict) -> BertConfig:
        return BertConfig.from_hf(d, position_offset=(1 if d.get("pad_token_id") is None else d["pad_token_id"]) + 1)

    @classmethod
    def _heads(cls, weights: dict[str, torch.Tensor]) -> dict:
        w = weights.get("classifier.out_proj.weight")
        return {"has_pooler": "pooler.dense.weight" in weights, "num_labels": 0 if w is None else w.shape[0]}

    def classify(self, hidden: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_labels]`` from the first token (``<s>``) of each sequence.

        Raises:
            RuntimeError: the checkpoint has no classification head.
        """
        if not self.num_labels:
            raise RuntimeError("this checkpoint has no sequence-classification head")
        return self.classifier(torch.tanh(self.head_dense(hidden[starts])))

    def head_names(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.pooler is not None:
            out |= {"pooler.dense.weight": self.pooler.weight, "pooler.dense.bias": self.pooler.bias}
        if self.num_labels:
            out |= {
                "classifier.dense.weight": self.head_dense.weight,
                "classifier.dense.bias": self.head_dense.bias,
                "classifier.out_proj.weight": self.classifier.weight,
                "classifier.out_proj.bias": self.classifier.bias,
            }
        return out


class XLMRobertaEncoderModel(RobertaEncoderModel):
    """XLM-RoBERTa: RoBERTa's architecture under the ``roberta.`` prefix as well."""

    PREFIXES = ("roberta.", "xlm_roberta.")
