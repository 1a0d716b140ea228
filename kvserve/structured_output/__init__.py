"""Structured outputs: constrained decoding with xgrammar (JSON schema, regex, choice, EBNF grammar).

- `grammar.py`: StructuredOutputsParams -> an xgrammar Grammar (front end: checked at admission, no
  tokenizer) or CompiledGrammar (engine core: against the model's vocabulary).
- `manager.py`: the engine core's side: compiles beside the step (a thread, cached by spec), keeps one
  matcher per request, fills the step's token bitmask, advances matchers over accepted tokens only.
The sampler applies the bitmask (sample/sampler.py); nothing else in the step knows about grammars.
"""
