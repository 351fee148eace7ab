"""vLLM's entry-point module paths, so its command lines work with only the package
name changed."""
