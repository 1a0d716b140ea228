"""Reading a checkpoint: where a model comes from and what its config says (loader.py, architectures.py), a
GGUF file's metadata, tokenizer and tensors (gguf_loader.py, gguf_blocks.py), tensors read lazily for a shard
(lazy_tensor.py), the name-checked copy into a built network (weight_loader.py) and random weights
(dummy.py). It builds no network (models/build.py does) and sits below config, which resolves a model with it."""
