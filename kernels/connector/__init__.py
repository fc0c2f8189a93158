"""agentkv's vLLM KV connector (loaded by vLLM from ``agentkv.kernels.connector.plugin``): the
adapter vLLM calls (``plugin``), its scheduler side (``scheduler``, ``held_blocks``, ``reuse_plan``),
its worker side (``worker``), its stats (``stats``), and the wire contract with the front
(``params``, standard library only: the one module of this package the server imports).

Nothing here imports vLLM at package import: ``params`` must load in the front without it."""
