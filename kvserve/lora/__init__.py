"""Multi-LoRA serving: adapter requests (request.py) and PEFT adapters read from disk and checked (adapter.py).
The front end's admission check is engine/lora_checker.py, the worker's resident slots with their host-memory
cache worker/lora_manager.py, and the batched matmul layers/lora.py."""
