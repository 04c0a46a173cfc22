"""Text and generation on top of the model: tokenizer, chat templates (sandboxed Jinja),
prompting, sampling, generation events and chat sessions. Importing this package installs the
model's "prompt_ids" and "stream" hooks (poly.model.hooks)."""

from poly.model.hooks import provide
from poly.text import prompting

provide("prompt_ids", prompting.prompt_to_ids)
provide("stream", prompting.stream)
