"""agentkv server: OpenAI-compatible front, sessions, vLLM launch."""
