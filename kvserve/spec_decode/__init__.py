"""Speculative decoding: a proposer guesses each request's next tokens, the target scores them all in one
forward pass beside the batch's other work, and the rejection sampler keeps the longest prefix the target
itself would have produced (sample/rejection_sampler.py). The draft-length policy decides per request and
step how many to propose, down to none, so speculation only runs where it buys tokens per second."""
