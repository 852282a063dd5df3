"""Offline API, vLLM-shaped::

    from pdserve.runtime import LLM, SamplingParams
    llm = LLM()                                   # default model; any EngineConfig option as a keyword
    out = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
from typing import Any

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.outputs import RequestOutput
from pdserve.runtime.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_name: str | None | list[str | None] = None) -> list[RequestOutput]:
        """Submit every prompt, step until all finish, return the outputs in input order. A flat list of ints is one
        tokenized prompt; ``sampling_params`` may be one for all or one per prompt, and so may ``lora_name`` (an
        adapter registered with ``llm.engine.add_lora``; None = the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora names for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, lora_name=lora)
                ids.append(rid)
            return self._run(ids)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or to a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        pending, done = set(ids), {}
        while pending:
            outputs = self.engine.step()
            for out in outputs:
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    done[out.request_id] = out
            if not outputs and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine idle with {len(pending)} unfinished requests")
        return [done[i] for i in ids]

    def get_stats(self):
        return self.engine.get_stats()

    def shutdown(self) -> None:
        self.engine.shutdown()
