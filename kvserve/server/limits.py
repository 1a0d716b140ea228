"""Per-request limits (ServerConfig's max_* flags): what one request may ask of the server.

Each check raises APIError 400 naming the field and the flag that bounds it. Checked before a request
reaches the engine, so a request that could never run is refused at once (never a 429 to retry).
"""
from __future__ import annotations

from kvserve.sampling_params import SamplingParams
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError


def check_sampling(config: ServerConfig, params: SamplingParams, num_prompts: int, capacity: int) -> None:
    """n, max_tokens, stop strings / ids and logit_bias against their flags; n x prompts against what the
    engine can hold at once (max_num_seqs + max_queue_len sequences)."""
    if params.n > config.max_n:
        raise APIError(400, f"n must be <= {config.max_n} (--max-n), got {params.n}", param="n")
    if params.n * num_prompts > capacity:
        raise APIError(400, f"{num_prompts} prompt(s) x n={params.n} = {params.n * num_prompts} sequences, more "
                            f"than this server can ever hold at once ({capacity}: --max-num-seqs + "
                            "--max-queue-len)", param="n")
    limit = config.max_tokens_limit
    if limit is not None and params.max_tokens is not None and params.max_tokens > limit:
        raise APIError(400, f"max_tokens must be <= {limit} (--max-tokens-limit), got {params.max_tokens}",
                       param="max_tokens")
    stops = params.stop_strings
    if len(stops) + len(params.stop_token_ids) > config.max_stop_strings:
        raise APIError(400, f"at most {config.max_stop_strings} stop strings and stop token ids "
                            f"(--max-stop-strings), got {len(stops) + len(params.stop_token_ids)}", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > config.max_stop_string_length:
        raise APIError(400, f"stop strings must be at most {config.max_stop_string_length} characters "
                            f"(--max-stop-string-length), got one of {longest}", param="stop")
    if params.logit_bias and len(params.logit_bias) > config.max_logit_bias:
        raise APIError(400, f"logit_bias may have at most {config.max_logit_bias} entries (--max-logit-bias), "
                            f"got {len(params.logit_bias)}", param="logit_bias")


def check_messages(config: ServerConfig, num_messages: int) -> None:
    if num_messages > config.max_messages:
        raise APIError(400, f"at most {config.max_messages} messages per request (--max-messages), "
                            f"got {num_messages}", param="messages")
