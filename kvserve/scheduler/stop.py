"""Token-level stop checks: which sampled tokens a request keeps, and whether it finishes with them. Stop
strings are the front end's (it aborts those requests)."""
from __future__ import annotations

from kvserve.request import Request, RequestStatus


def stop_status(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Whether `token`, just appended to req, finishes it (EOS, a stop token, max_tokens, max_model_len)."""
    params = req.sampling_params
    if req.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_until_stop(req: Request, tokens: list[int], max_model_len: int) -> tuple[list[int], RequestStatus | None]:
    """Append the sampled tokens to req up to and including the first that stops it; returns those appended
    and the stop status (None: it runs on)."""
    appended = []
    for token in tokens:
        req.append_output_token(token)
        appended.append(token)
        status = stop_status(req, token, max_model_len)
        if status is not None:
            return appended, status
    return appended, None

