"""Varied prompts for end-to-end tests."""

LONG_DOC = " ".join(
    f"Section {i}: The quick brown fox number {i} jumps over {i % 7} lazy dogs while the river "
    f"carries {i * 3} leaves toward the sea, and the committee records item {i} in its ledger."
    for i in range(40))

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three uses of a paperclip:\n1.",
    "Translate to French: 'Good morning, how are you?'",
    "The derivative of x^2 with respect to x is",
    "import numpy as np\n# compute the mean of an array\n",
    "Summarise the following report.\n\n" + LONG_DOC + "\n\nSummary:",
]
