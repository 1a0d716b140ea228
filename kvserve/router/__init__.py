"""`kvserve router`: one OpenAI-compatible front for several `kvserve serve` workers, routing each request by
load and by what the workers' prefix caches hold (docs/SCALING.md)."""
