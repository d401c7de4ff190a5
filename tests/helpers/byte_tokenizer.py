"""A byte-level BPE tokenizer trained on English plus multi-byte text, for the detokenizer and stop-string tests."""

MULTIBYTE = [
    "日本語のテキスト",
    "中文字符",
    "한국어 문장",
    "emoji 🎉🎉 party 👩‍👩‍👧",
    "naïve café — “quoted” ½ €",
    "Ελληνικά κείμενο",
]


def byte_level_tokenizer(out_dir, vocab_size: int = 600):
    """A BART tokenizer (byte-level BPE, as ``text_checkpoints.build_bart``) trained on English plus multi-byte
    text, so merges cut UTF-8 characters at many byte offsets. Loaded through ``AutoTokenizer`` as the server does."""
    from helpers.text_checkpoints import corpus
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer, BartTokenizer

    bpe = ByteLevelBPETokenizer()
    texts = corpus(1500) + [f"{a} {b}" for a in MULTIBYTE for b in MULTIBYTE] * 3
    bpe.train_from_iterator(
        texts,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        show_progress=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(out_dir))
    BartTokenizer(vocab=str(out_dir / "vocab.json"), merges=str(out_dir / "merges.txt")).save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)
