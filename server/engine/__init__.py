"""The vLLM engine: the child process (``process``), its supervisor (``supervisor``), the front's
client to it on its Unix socket (``client``), and the summarizer's model over it (``summarizer``)."""
