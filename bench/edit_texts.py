"""Texts of the ``edit`` workload: requests whose answers copy from their prompts (rewrite a
passage with one change, repeat a code block), what prompt-lookup speculation is for.

Prompts are chat messages rendered with the model's template, so the model sees a real task.
"""

from __future__ import annotations

PASSAGES = (
    "The quick brown fox jumps over the lazy dog near the river bank, while the farmer "
    "watches from his porch and sips a cup of hot coffee in the early morning light.",
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre museum, "
    "and its cafes. Millions of tourists visit the city every year to enjoy its art and food.",
    "def add(a, b):\n    return a + b\n\n\ndef multiply(a, b):\n    result = 0\n"
    "    for _ in range(b):\n        result = add(result, a)\n    return result\n",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air "
    "pressure is lower, so water boils at a lower temperature and food takes longer to cook.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "The meeting is scheduled for Monday at ten in the morning in the main conference room. "
    "Please bring your laptop, the quarterly report and any questions about the new budget.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to make glucose and oxygen. It takes place mainly in the leaves of the plant.",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' AND active = 1 "
    "ORDER BY name ASC LIMIT 50;",
)
INSTRUCTIONS = (
    "Repeat the following text exactly, then stop:\n\n{}",
    "Rewrite the following text, changing only the first word to uppercase:\n\n{}",
)


def edit_messages(index: int) -> list[dict[str, str]]:
    """The chat of request ``index`` (passages cycle, then instructions)."""
    passage = PASSAGES[index % len(PASSAGES)]
    instruction = INSTRUCTIONS[(index // len(PASSAGES)) % len(INSTRUCTIONS)]
    return [{"role": "user", "content": instruction.format(passage)}]
