"""A logits processor for the Anthropic API's thinking tests: every request writes exactly the
deployment's `plugin_options.scripted.text`, then EOS, so what the server splits into a thinking
block and a text block is known. Loaded by a test server through its config's `plugins:` list."""

import torch
from pydantic import BaseModel

from cadenza.plugins.hookspecs import hookimpl
from cadenza.samplers.base import LogitsProcessor, SamplingBatch


class ScriptedOptions(BaseModel):
    text: str


class Scripted(LogitsProcessor):
    name = "scripted"
    options_model = ScriptedOptions

    def __init__(self, context, options=None) -> None:
        super().__init__(context, options)
        self.script = context.tokenizer.encode(self.options.text, add_special_tokens=False)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        for row, output in enumerate(batch.output_token_ids):
            position = len(output)
            token = self.script[position] if position < len(self.script) else self.context.eos_token_ids[0]
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0
        return logits


@hookimpl
def register_samplers(register):
    register(Scripted.name, Scripted)
