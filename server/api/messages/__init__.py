"""Anthropic Messages: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""
