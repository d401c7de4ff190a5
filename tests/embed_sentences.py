"""Varied test sentences for the Embed parity tests (the real all-MiniLM-L6-v2)."""

LONG = ("Serving systems batch requests of different lengths together, and every padded position costs compute "
        "that produces nothing; sorting by length and packing tokens keeps that waste small. ") * 6  # > 256 tokens

SENTENCES = [
    "", " ", "   \t\n ", "hello", "Hello!", "a", "?", "🙂", "🚀🔥💯", "I love pizza 🍕 and sushi 🍣.",
    "日本語の文章です。", "我喜欢喝茶。", "한국어 문장입니다.", "Привет, как дела?", "Ünïcödé àccents éverywhere",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A monkey is playing drums.", "A cheetah is running behind its prey.",
    "What is the capital of France?", "Paris is the capital and most populous city of France.",
    "Machine learning models need data.", "Transformers use attention to mix information across tokens.",
    "The stock market fell sharply on Monday after the announcement.",
    "She sells sea shells by the sea shore.", "How do I reset my password?", "Click 'Forgot password' on the login page.",
    "Error 404: page not found", "def add(a, b): return a + b", "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path?query=1&other=two", "user@example.com", "3.14159 2.71828 1.41421",
    "!!!???...", "UPPERCASE WORDS SHOUTING LOUDLY", "mixed CASE and 123 numbers 456",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.",
    "Deep in the forest, an old oak tree stood alone, its branches heavy with snow, waiting for spring to return.",
    "The meeting is moved to 3 pm tomorrow; please update your calendars and bring the quarterly report.",
    "Café naïve résumé coöperate", "emoji 👩‍💻 with zero-width joiners 👨‍👩‍👧‍👦", "tab\tseparated\tvalues",
    LONG, "word " * 400, "日本語" * 200,
]
assert len(SENTENCES) == 50, len(SENTENCES)
