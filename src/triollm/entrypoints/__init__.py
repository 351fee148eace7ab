"""The front end shared by the server and the offline ``LLM``, at vLLM's module paths:
chat messages to prompt tokens (``chat_utils``), score and rerank pairs
(``score_utils``), and ``openai.api_server`` so vLLM's command lines work with only
the package name changed."""
