"""Structured output (response_format, tools): a token mask per choice. Plain text for now."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Plan:
    mask_factory: object = None
    tools: list | None = None
    buffered: bool = False  # tool calls: the whole text is parsed at the end

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        return {"role": "assistant", "content": text}, finish


def plan(state, body: dict) -> Plan:
    return Plan(tools=body.get("tools") or None)
