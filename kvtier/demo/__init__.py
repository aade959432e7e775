"""``kvtier demo``: long-document QA on a real model through vLLM with kvtier off, on, and after a restart."""
