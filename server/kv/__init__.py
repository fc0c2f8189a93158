"""The front's half of KV reuse after clearing: what it tells the connector (``reuse``), which moved
tokens blend recomputes (``blend``), and the deviation probe (``probe``)."""
