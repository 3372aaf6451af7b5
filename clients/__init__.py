"""rewa.clients: the HTTP client, CLI and LLM-pipeline integration. Built by the issue "Python
client, CLI, and the LLM-pipeline external-memory integration"."""
