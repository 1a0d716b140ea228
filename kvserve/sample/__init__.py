"""Token sampling: batched sampling metadata and the Sampler."""
from kvserve.sample.metadata import PenaltyTensors, SamplingMetadata, SamplingRow, SparseLogits
from kvserve.sample.sampler import RowLogprobs, Sampler, SamplerOutput

__all__ = ["PenaltyTensors", "RowLogprobs", "Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow",
           "SparseLogits"]
