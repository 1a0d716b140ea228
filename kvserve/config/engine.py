"""EngineConfig: every resolved config of one engine, composed (what the worker and scheduler are built from)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.cache import CacheConfig
from kvserve.config.device import DeviceConfig
from kvserve.config.kv_transfer import KVTransferConfig
from kvserve.config.kv_events import KVEventsConfig
from kvserve.config.load import LoadConfig
from kvserve.config.lora import LoRAConfig
from kvserve.config.model import ModelConfig
from kvserve.config.parallel import ParallelConfig
from kvserve.config.quantization import QuantizationConfig
from kvserve.config.scheduler import SchedulerConfig
from kvserve.config.speculative import SpeculativeConfig
from kvserve.model_loader.architectures import block_release_window


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    load: LoadConfig
    speculative: SpeculativeConfig | None = None
    draft_model: ModelConfig | None = None
    """speculative method draft_model: the draft checkpoint (target's vocabulary, dtype and max_model_len)."""
    lora: LoRAConfig | None = None
    """enable_lora: adapter slots and limits; None: the base model only."""
    quantization: QuantizationConfig = QuantizationConfig()
    """The target model's weight-only quantization (the draft model stays unquantized)."""
    seed: int = 0
    """Seed of the default generator that unseeded requests draw from."""
    kv_transfer: KVTransferConfig | None = None
    """--kv-transfer-config: the KV connector (kv_transfer/); None: none."""
    kv_events: KVEventsConfig | None = None
    """--kv-events-config: publish what enters and leaves the prefix cache; None: off."""

    @property
    def kv_release_window(self) -> int | None:
        """Every layer attends through a window of at most this many positions: the KV cache manager releases
        a running request's blocks before its window. None with a draft model (its layers read the same blocks
        from wherever it last stopped) or when some layer attends to the whole sequence."""
        if self.draft_model is not None:
            return None
        return block_release_window(self.model.hf_config)
