"""The chat template of the embedded models: ChatML with Hermes-style tool calls."""

from __future__ import annotations

import json
from importlib import resources


def chat_template(default_system: str | None = None) -> str:
    """The template text; ``default_system`` is the system message used when a conversation has
    none (the one SmolLM2 was trained with)."""
    body = resources.files(__package__).joinpath("chat_template.jinja").read_text()
    if default_system is None:
        return body
    return "{%- set default_system = " + json.dumps(default_system) + " -%}\n" + body
