"""A serving engine whose output is forced (test plug): no weights, no device. Each request gets the recorded answer
that `answer_for(prompt text)` picks, token by token, a few tokens per step, then EOS; budgets and cancellation
behave as SlotEngine's (a request ends at its max_new tokens, "length", or at EOS, "stop"). The scheduler, the HTTP
app, decoding, stop strings and the output parsers above it are the real ones.

`python -m tests.forced_engine` prints the transcript docs/serving.md shows: the openai client sends a tools
request to `serve` over this plug with Kimi-K2.5's chat template, receives a tool call, sends the tool result and
receives the answer.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from typing import Callable

import numpy as np

from jaxspec.serving.prefix_index import PrefixIndex
from jaxspec.serving.slot_engine import StepResult

TOKENS_PER_STEP = 3  # a step hands out a few tokens, as a speculative cycle does


@dataclasses.dataclass(frozen=True)
class _Target:
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class _Config:
    eos_ids: tuple[int, ...]
    target: _Target


class ForcedEngine:
    def __init__(self, tokenizer, answer_for: Callable[[str], str], eos_ids: tuple[int, ...], max_batch: int = 4,
                 max_context: int = 4096):
        self.tokenizer, self.answer_for = tokenizer, answer_for
        self.cfg = _Config(tuple(eos_ids), _Target(len(tokenizer.special_tokens) + 10**6))
        self.max_batch, self.max_context, self.k = max_batch, max_context, 0
        self.prompts: list[str] = []  # every prompt prefilled, as text (tests read what the template rendered)
        self.prefix = PrefixIndex(0, 64)  # no prefix cache
        self.reset()

    def reset(self) -> None:
        self._slots: dict[int, dict] = {}

    def max_new_tokens(self, prompt_len: int) -> int:
        return self.max_context - prompt_len - 1

    def has_room(self, prompt_len, max_new) -> bool:
        return True

    def free_slots(self, slots) -> None:
        pass

    def slots_to_preempt(self) -> list[int]:
        return []  # no paged cache

    def admits_in_chunks(self, tokens) -> bool:
        return False  # every prompt "prefills" at once: its answer is recorded

    def prefill(self, slot, tokens, max_new, sampling, seed):
        prompt = self.tokenizer.decode(tokens)
        self.prompts.append(prompt)
        answer = self.tokenizer.encode(self.answer_for(prompt)) + [self.cfg.eos_ids[0]]
        state = {"answer": answer[:max_new], "next": 1}
        done = len(state["answer"]) == 1
        if not done:
            self._slots[slot] = state
        return answer[0], done

    def step(self, cancel: np.ndarray, any_sampled: bool) -> StepResult:
        tokens, done = [[] for _ in range(self.max_batch)], np.zeros(self.max_batch, bool)
        for slot in [s for s in self._slots if cancel[s]]:
            del self._slots[slot]
        for slot, st in list(self._slots.items()):
            tokens[slot] = st["answer"][st["next"]: st["next"] + TOKENS_PER_STEP]
            st["next"] += len(tokens[slot])
            if st["next"] >= len(st["answer"]):
                done[slot] = True
                del self._slots[slot]
        emitted = sum(map(len, tokens))
        return StepResult(tokens, done, accepted=0, slot_cycles=emitted, cycles=1, k=0)


def forced_service(tokenizer, answer_for, eos_ids, template_kwargs=None, max_batch: int = 4):
    """A Service over the plug (scheduler, metrics and app as `serve` builds them)."""
    from jaxspec.serving.app import Service
    from jaxspec.serving.metrics import Metrics
    from jaxspec.serving.scheduler import Scheduler

    engine = ForcedEngine(tokenizer, answer_for, eos_ids, max_batch)
    metrics = Metrics(max_batch)
    return Service(Scheduler(engine, metrics, 16), tokenizer, metrics, "kimi-k2.5-forced",
                   template_kwargs=template_kwargs or {})


# --- the recorded conversation the transcript (and tests/test_serve_tools.py) uses -------------------------------
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# K2.5 thinks first (its prompt ends in an open <think>), then calls the function in its own format
TOOL_CALL_ANSWER = ("The user asks for the weather in Paris; get_weather gives it.</think>"
                    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
FINAL_ANSWER = "The tool says 18 °C and cloudy.</think>It is 18 °C and cloudy in Paris."


def weather_answer(prompt: str) -> str:
    """The tool call, or the answer once the prompt holds the tool's result."""
    return FINAL_ANSWER if "## Return of" in prompt else TOOL_CALL_ANSWER


def main() -> None:
    import openai

    from jaxspec.serving.background import BackgroundServer
    from jaxspec.tokenizer import load_tokenizer
    from tests.kimi_chat_templates import KIMI_K25
    from tests.kimi_tokenizer_fixture import write_kimi_tokenizer

    directory = tempfile.mkdtemp()
    write_kimi_tokenizer(directory, KIMI_K25)
    tok = load_tokenizer(directory)
    service = forced_service(tok, weather_answer, (tok.special_tokens["<|im_end|>"],))
    with BackgroundServer(service) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        print(">>> client.chat.completions.create(model=..., messages=messages, tools=[WEATHER_TOOL])")
        r = client.chat.completions.create(model="kimi-k2.5-forced", messages=messages, tools=[WEATHER_TOOL])
        print(json.dumps(r.choices[0].model_dump(exclude_none=True), indent=1, ensure_ascii=False))
        call = r.choices[0].message.tool_calls[0]
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "cloudy"}'}]
        print(">>> messages += [that message, {'role': 'tool', 'tool_call_id': call.id, 'content': ...}]")
        print(">>> the prompt the template rendered for the second request:")
        r2 = client.chat.completions.create(model="kimi-k2.5-forced", messages=messages, tools=[WEATHER_TOOL])
        print(service.engine.prompts[-1])
        print(json.dumps(r2.choices[0].model_dump(exclude_none=True), indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
