"""Reading a checkpoint: where a model comes from and what its config says (loader.py, architectures.py; its
parameter count: param_count.py), a GGUF file's metadata, tokenizer and tensors (gguf_loader.py; per
architecture gguf_archs.py and gguf_config.py; kept blocks gguf_blocks.py), tensors read lazily for a shard
(lazy_tensor.py), the name-checked copy into a built network (weight_loader.py) and random weights
(dummy.py). It builds no network (models/build.py does) and sits below config, which resolves a model with it."""
