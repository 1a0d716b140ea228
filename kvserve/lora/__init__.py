"""Multi-LoRA serving: adapter requests (request.py), PEFT adapters loaded and checked against the model
(adapter.py), and the worker's resident slots with their host-memory cache (manager.py). The batched matmul
lives in layers/lora.py."""
