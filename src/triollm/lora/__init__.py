"""LoRA adapters: ``triollm.lora.request.LoRARequest`` names one (vLLM's module path), a
plain value that crosses the engine/model boundary. The layers and the adapter loading
are model code, in ``triollm.model.lora``."""
