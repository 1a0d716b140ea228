"""Engine configuration: `EngineArgs` (the flat, user-facing flags: CLI and `LLM(**kwargs)`) and the
configs it resolves into, one per concern, composed into one `EngineConfig`."""
from kvserve.config.cache import CacheConfig
from kvserve.config.device import DeviceConfig
from kvserve.config.engine import EngineConfig
from kvserve.config.engine_args import EngineArgs
from kvserve.config.load import LoadConfig
from kvserve.config.lora import LoRAConfig
from kvserve.config.model import ModelConfig
from kvserve.config.parallel import ParallelConfig
from kvserve.config.quantization import QuantizationConfig
from kvserve.config.scheduler import SchedulerConfig
from kvserve.config.speculative import SpeculativeConfig

__all__ = ["EngineArgs", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig",
           "DeviceConfig", "LoadConfig", "LoRAConfig", "SpeculativeConfig",
           "QuantizationConfig"]
