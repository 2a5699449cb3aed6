"""`pdserve bench serve`: an OpenAI-HTTP load generator measuring any server by vLLM's metrics."""
