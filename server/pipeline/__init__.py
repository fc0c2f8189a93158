"""What every API shares, in request order: the session a request belongs to (``sessions``), the
server-executed tools (``server_tools``), the context step (``context``), the turn that strings them
together with KV reuse (``turn``), and the engine call with server-tool rounds (``engine_call``)."""
