"""Tiny random BERT / RoBERTa / XLM-R sequence-classification checkpoints with a
tokenizer trained at test time (``tokenizers``), saved with ``save_pretrained``
so tests load them through the registry exactly as a user's directory.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = (
    "the a cat dog house river blue green quick slow runs jumps over under near far tree stone light dark morning "
    "evening rain snow wind sun moon star city road bridge boat train small large old new red white what where is "
    "are does how many who likes paris france capital of music song book reads"
).split()

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def corpus(n: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) + rng.choice([".", "?", "!"]) for _ in range(n)
    ]


def _wordpiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(corpus(), trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def _bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # RoBERTa's ids: <s> 0, <pad> 1, </s> 2
    tok.train_from_iterator(
        corpus(),
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.post_processor = processors.RobertaProcessing(
        ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))
    )
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        cls_token="<s>",
        sep_token="</s>",
        mask_token="<mask>",
        model_max_length=512,
        model_input_names=["input_ids", "attention_mask"],
    )


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale random weights so scores spread out (HF's 0.02 init makes them all alike)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embeddings" in name else p.shape[1] ** -0.5))
            elif "LayerNorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def build_classifier(out: Path, kind: str, num_labels: int, seed: int = 0) -> Path:
    """Writes a random ``{Bert,Roberta,XLMRoberta}ForSequenceClassification`` checkpoint to ``out``.

    Args:
        kind: ``bert``, ``roberta`` or ``xlm-roberta``.
        num_labels: 1 makes a cross-encoder (Rerank), more a classifier.
    """
    import transformers

    tokenizer = _wordpiece_tokenizer() if kind == "bert" else _bpe_tokenizer()
    cls_name = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[kind]
    common = dict(
        TINY,
        vocab_size=len(tokenizer),
        num_labels=num_labels,
        id2label={i: f"label_{chr(97 + i)}" for i in range(num_labels)},
        label2id={f"label_{chr(97 + i)}": i for i in range(num_labels)},
    )
    if kind == "bert":
        config = transformers.BertConfig(**common, max_position_embeddings=128, pad_token_id=0)
    else:
        config = getattr(transformers, f"{cls_name}Config")(
            **common, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2
        )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls_name}ForSequenceClassification")(config).eval()
    _reinit(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
