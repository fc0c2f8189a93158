"""The engine's render of prompts, in the front: vLLM's own chat preprocessing, its tokenization
incremental per conversation (``engine_chat``)."""
