"""agentkv.compaction: context management over OpenAI chat message lists."""
