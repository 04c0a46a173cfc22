"""Text and generation on top of the model: tokenizer, chat templates (sandboxed Jinja),
prompting, sampling, generation events and chat sessions. Importing this package installs the
model's "prompt_ids" and "stream" hooks (poly.model.hooks)."""

from poly.model.hooks import provide

provide("prompt_ids", "poly.text.prompting:prompt_to_ids")
provide("stream", "poly.text.prompting:stream")
