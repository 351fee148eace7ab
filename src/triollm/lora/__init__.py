"""LoRA adapters: ``triollm.lora.request.LoRARequest`` names one (vLLM's module path).
The layers and the adapter loading are model code, in ``triollm.model``."""
