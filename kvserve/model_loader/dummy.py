"""`--load-format dummy` (vLLM's name): random weights of a model's real shapes, from its config.json alone, so
an 8B-shaped model can be served and benchmarked with no download (kvserve/models/configs/ holds the
configs of a few real models).

The weights are drawn on the model's device from one seeded generator: matrices N(0, 0.02) as
transformers initialises them, norms 1, biases 0, so activations keep a sane range in bf16 and a forward
pass costs what the real model's does. Outputs are meaningless; speed and memory are real.

A folder with only config.json has no tokenizer: `IdTokenizer` stands in for one, so prompts go in as
token ids and outputs come back as ids (their text is the ids, space-separated).
"""
from __future__ import annotations

import os

import torch
from torch import nn

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "configs")
"""Real models' config.json files, one folder each (usable as --model with --load-format dummy); they ship with
the model code, in kvserve/models/configs."""
_STD = 0.02
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def builtin_config_dir(name: str) -> str:
    """The folder of a config shipped in kvserve/models/configs (e.g. "Llama-3-8B")."""
    path = os.path.join(CONFIGS_DIR, name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        known = ", ".join(sorted(os.listdir(CONFIGS_DIR)))
        raise ValueError(f"no built-in config {name!r}; known: {known}")
    return path


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, then let layers finish their weights as after a checkpoint load
    (prepacking, quantizing)."""
    generator = None
    for name, param in model.named_parameters():  # a tied LM head is the embedding: visited once
        if generator is None:
            generator = torch.Generator(param.device).manual_seed(seed)
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:  # RMSNorm weights
            param.fill_(1.0)
        else:
            # NOTE: drawn in float32 then cast: normal_ has no generator path for every half type on CPU.
            param.copy_(torch.empty(param.shape, device=param.device).normal_(0.0, _STD, generator=generator))
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def has_tokenizer(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


class IdTokenizer:
    """The tokenizer of a dummy model whose folder has none: token ids only."""

    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens: bool = True):
        raise ValueError("this model folder has no tokenizer (--load-format dummy): pass prompts as token ids")

    def __call__(self, text, **kwargs):
        self.encode(text)

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("this model folder has no tokenizer or chat template (--load-format dummy): pass "
                         "prompts as token ids")

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(t)}" for t in token_ids)

    def batch_decode(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def convert_ids_to_tokens(self, token_ids):
        return [str(int(t)) for t in token_ids]
